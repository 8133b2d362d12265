from gpusnap.cli.main import main

main()

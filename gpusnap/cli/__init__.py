"""The `gpusnap` command line: one module per verb, over the library."""

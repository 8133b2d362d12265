"""Probe: a driver restore refused for memory, then tried again once memory is free."""
import os, subprocess, sys, time
sys.path.insert(0, os.getcwd())
from gpusnap.gpu.cuda import CudaDriver
T = "/opt/torch/.venv/bin/python3"
app = subprocess.Popen([T, "-c", "import torch,time,sys; x=torch.ones(256<<20, device='cuda'); print('up', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
assert app.stdout.readline().strip() == "up"
d = CudaDriver(); pid = app.pid
d.lock(pid, 10000); d.checkpoint(pid); print("state", d.state(pid))
free = int(subprocess.check_output(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"]).split()[0])
hog = subprocess.Popen([T, "-c", f"import torch,time; x=torch.empty(({free}-700)<<20, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); print('hog', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
print(hog.stdout.readline().strip())
for k in range(2):
    try: d.restore(pid); print("restore ok?!")
    except Exception as e: print("restore 1:", e)
    print("state after", d.state(pid))
hog.kill(); hog.wait(); time.sleep(1)
for k in range(3):
    try: d.restore(pid); print("restore again ok"); break
    except Exception as e: print("restore again:", e); time.sleep(1)
print("state", d.state(pid))
try: d.unlock(pid); print("unlocked", d.state(pid))
except Exception as e: print("unlock:", e)
app.kill()

"""A stand-in training process for tests/test_multiprocess.py's launcher test (no JAX).

Process 0 writes its pid to $PROBE_DIR/pid_0 and sleeps (a trainer waiting in a collective);
process 1 prints its environment to $PROBE_DIR/env_1 and exits with code 3 (a trainer that died).
"""

import json
import os
import sys
import time
from pathlib import Path

out = Path(os.environ["PROBE_DIR"])
index = int(os.environ["JAX_PROCESS_ID"])
if index == 0:
    (out / "pid_0").write_text(str(os.getpid()))
    time.sleep(600)
else:
    keys = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "XLA_FLAGS")
    (out / f"env_{index}").write_text(json.dumps({k: os.environ.get(k) for k in keys} | {"argv": sys.argv[1:]}))
    time.sleep(1)
    sys.exit(3)

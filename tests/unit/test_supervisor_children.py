"""`deltamesh serve`'s supervisor with stand-in children (plain Python processes): a child that exits with the
configuration-error status stops the mesh at once, with no restart; a child started for serve stops when serve
is killed, SIGKILL included."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from deltamesh.services.supervisor import CONFIG_ERROR, ChildSpec, Supervisor


def test_a_child_that_cannot_serve_its_configuration_stops_the_mesh_without_a_restart(capfd):
    exits = ChildSpec("decode-0", [sys.executable, "-c", f"raise SystemExit({CONFIG_ERROR})"], dict(os.environ))
    sleeps = ChildSpec("router", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    supervisor = Supervisor([sleeps, exits])
    assert supervisor.run() == 1
    assert [c.restarts for c in supervisor.children] == [0, 0]
    # at once: serve stopped the sleeping child (SIGTERM), it did not wait out its minute
    assert supervisor.children[0].popen.returncode == -signal.SIGTERM
    assert "decode-0 cannot serve this configuration" in capfd.readouterr().err


def running(pid: int) -> bool:
    """Alive (not gone, and not a zombie waiting for whoever adopted it to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_of_serve_stops_when_serve_is_killed(tmp_path):
    """A stand-in for serve starts a child as serve does (its pid handed over); SIGKILL of the stand-in: the
    child gets SIGTERM from the kernel (it records it) and exits."""
    record = tmp_path / "child"
    child = textwrap.dedent(f"""
        import os, signal, sys, time
        from deltamesh.services.supervisor import die_with_parent
        signal.signal(signal.SIGTERM, lambda *_: (open({str(record)!r}, "w").write("SIGTERM"), sys.exit(0)))
        die_with_parent(int(os.environ["PARENT"]))
        print(os.getpid(), flush=True)
        time.sleep(60)
    """)
    parent = textwrap.dedent(f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {child!r}], env={{**os.environ, "PARENT": str(os.getpid())}})
        time.sleep(60)
    """)
    serve = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(serve.stdout.readline())
        serve.send_signal(signal.SIGKILL)
        serve.wait(10)
        deadline = time.monotonic() + 30  # a poll: the child's own stop, slow only on a loaded machine
        while running(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child_pid) and record.read_text() == "SIGTERM"
    finally:
        serve.kill()

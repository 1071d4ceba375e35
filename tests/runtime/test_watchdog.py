"""hvdtrain.runtime.watchdog in one process: the stall check fires, names where the rank was, and a pause
(an elastic reset's wait for Horovod's driver) delays it but never disables it. Multi-rank stalls
(a frozen, wedged or killed rank named by the others) are in test_faults.py."""
import subprocess
import sys
import textwrap
import time

from tests.helpers.ranks import REPO


def _run_watchdog(body: str, timeout_s: float = 1) -> tuple:
    """Run ``body`` after ``dog = Watchdog(rank=lambda: 0, timeout_s=timeout_s, poll_s=0.05)``, in a process
    of its own (a stall ends the process); returns (exit status, stderr, seconds from the watchdog's
    creation to the end of the process: imports are not counted)."""
    script = "import time\nfrom hvdtrain.runtime.watchdog import Watchdog\n" \
             f"dog = Watchdog(rank=lambda: 0, timeout_s={timeout_s}, poll_s=0.05)\n" \
             "print(time.time(), flush=True)\n" + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr, time.time() - float(proc.stdout.split()[0])


def test_a_rank_without_progress_aborts_with_status_3_naming_where_it_was():
    rc, err, _ = _run_watchdog("""
        dog.arm("epoch 1, step 7")
        time.sleep(30)
    """)
    assert rc == 3, err
    assert "rank 0 made no progress" in err and "after epoch 1, step 7" in err, err


def test_beats_keep_a_rank_alive():
    """3 s of steps, each well within the timeout (5 s: a loaded machine may stall a process for a second)."""
    rc, err, _ = _run_watchdog("""
        dog.arm("step 0")
        for step in range(30):
            time.sleep(0.1)
            dog.beat(f"step {step}")
        dog.close()
    """, timeout_s=5)
    assert rc == 0, err


def test_a_pause_delays_the_stall_check_by_its_length_and_then_expires():
    """Paused for 2 s with a 1 s timeout, a rank that never beats again aborts after more than 3 s
    (not after 1 s: the pause holds) and well before the 30 s it would sleep (the pause is finite)."""
    rc, err, ran_s = _run_watchdog("""
        dog.arm("epoch 2, step 3")
        dog.pause("waiting for Horovod's driver", max_s=2)
        time.sleep(30)
    """)
    assert rc == 3, err
    assert "after waiting for Horovod's driver" in err, err
    assert 3.0 < ran_s < 25, ran_s


def test_a_beat_ends_a_pause():
    """After the pause's first beat the ordinary timeout applies again, not what was left of the pause."""
    rc, err, ran_s = _run_watchdog("""
        dog.arm("start")
        dog.pause("resetting", max_s=1000)
        dog.beat("epoch 3, step 0")
        time.sleep(30)
    """)
    assert rc == 3, err
    assert "after epoch 3, step 0" in err, err
    assert ran_s < 25, ran_s

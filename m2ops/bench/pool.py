"""Worker processes of the benchmark, one per peer (worker.py --serve), each restarted after a failure or a
timeout so that no point runs in a process another point has broken; or, with fresh, one per peer and point."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time


class _Worker:
    def __init__(self, cmd=None, env=None):
        self.log = tempfile.TemporaryFile(mode="w+")  # stderr, for the tail of a crash report
        self.proc = subprocess.Popen(cmd or [sys.executable, "-m", "m2ops.bench.worker", "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1, env=env)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.pending = b""  # stdout read but not yet split into lines
        self.stopped = False

    def ask(self, job: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            # Raw reads, not readline: a peer's progress output without a newline must not block the timeout.
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                if line.startswith(b"RESULT "):
                    return json.loads(line[len(b"RESULT "):].decode())
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                self.stop()
                return {"error": f"timeout after {timeout:.0f} s"}
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the process died without answering
                code = self.proc.wait()
                return {"error": f"exit code {code}: {' / '.join(self._stderr_tail())}"[:300]}
            self.pending += chunk

    def _stderr_tail(self):
        self.log.seek(0)
        return self.log.read().strip().splitlines()[-3:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        if self.stopped:
            return
        self.stopped = True
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self.sel.close()
        self.log.close()


class Pool:
    """pool.run(peer, job, timeout) -> the worker's result dict; a worker per peer, started on demand (with
    env as its environment, e.g. CUDA_VISIBLE_DEVICES naming its GPU; default: this process's). With fresh, every
    point gets a worker of its own, which ends after it."""

    def __init__(self, env=None, fresh=False):
        self.workers: dict = {}
        self.env = env
        self.fresh = fresh  # a new worker for every point, ended after it (python -m m2ops.bench --fresh)

    def run(self, peer: str, job: dict, timeout: float) -> dict:
        w = self.workers.get(peer)
        if w is None or not w.alive():
            if w is not None:
                w.stop()
            w = self.workers[peer] = _Worker(env=self.env)
        result = w.ask(job, timeout)
        if "error" in result:  # the worker exits after a failure; the next point gets a fresh one
            w.stop()
            del self.workers[peer]
        elif self.fresh:
            self._retire(peer)
        return result

    def _retire(self, peer):
        """End peer's worker after its point: its stdin closed, it returns from its loop and exits."""
        w = self.workers.pop(peer)
        if w.alive():
            w.proc.stdin.close()  # end of jobs: the worker returns
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        w.stop()

    def close(self):
        for peer in list(self.workers):
            self._retire(peer)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


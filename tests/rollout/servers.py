"""A guarded rollout server process for the remote-engine tests, and a plain HTTP call with the token."""
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "test-token-" + "x" * 20


class Server:
    """One launch/rollout_server.py process (its own session: killing the group takes vLLM's engine core too)."""

    def __init__(self, model: str, port: int, log: str, token: str = TOKEN, args=(), env=None):
        self.model, self.port, self.log_path, self.token = model, port, log, token
        self.args, self.env = list(args), dict(env or {})
        self.url = f"http://127.0.0.1:{port}"
        self.start()

    def start(self, timeout: float = 300):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                 "MASTER_PORT")}
        env.update(self.env, MGRPO_SERVER_TOKEN=self.token)
        self.log = open(self.log_path, "a")
        seen = self.log.tell()  # a restart appends: only what this process writes counts
        self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "rollout_server.py"), "--model",
                                      self.model, "--port", str(self.port), *self.args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        deadline = time.time() + timeout
        while f"ready: http://127.0.0.1:{self.port}" not in open(self.log_path).read()[seen:]:
            assert self.proc.poll() is None, open(self.log_path).read()[-3000:]
            assert time.time() < deadline, "the rollout server did not become ready"
            time.sleep(0.5)

    def signal(self, sig):
        os.killpg(self.proc.pid, sig)

    def stop(self):
        try:
            self.signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def http(url: str, method: str = "GET", token: str | None = TOKEN, body: bytes | None = None, timeout: float = 30):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()

"""A guarded rollout server process for the remote-engine tests (plain HTTP or TLS with a self-signed
certificate), and an HTTP call with the token."""

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

    def __init__(
        self, model: str, port: int, log: str, token: str = TOKEN, args=(), env=None, tls_dir=None, timeout: float = 300
    ):
        """tls_dir: serve https with a certificate for 127.0.0.1 made there (`self.cert` is what clients trust)."""
        self.model, self.port, self.log_path, self.token = model, port, log, token
        self.args, self.env = list(args), dict(env or {})
        self.url, self.cert, self.context = f"http://127.0.0.1:{port}", None, None
        if tls_dir:
            import ssl

            self.cert, key = self_signed(str(tls_dir))
            self.args += ["--ssl-certfile", self.cert, "--ssl-keyfile", key]
            self.url, self.context = f"https://127.0.0.1:{port}", ssl.create_default_context(cafile=self.cert)
        for attempt in range(3):  # free_port() is only a guess: another process may take the port before the bind
            try:
                self.start(timeout)
                return
            except AssertionError as exc:
                if "is already in use" not in str(exc) or attempt == 2:
                    raise
                from mgrpo.parallel.distributed import free_port

                self.log.close()
                old, self.port = self.port, free_port()
                self.url = self.url.replace(f":{old}", f":{self.port}")

    def start(self, timeout: float = 300):
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        env.update(self.env, MGRPO_SERVER_TOKEN=self.token)
        self.log = open(self.log_path, "a")
        seen = self.log.tell()  # a restart appends: only what this process writes counts
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "launch", "rollout_server.py"),
                "--model",
                self.model,
                "--port",
                str(self.port),
                *self.args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        deadline = time.time() + timeout
        while f"ready: {self.url}" not in open(self.log_path).read()[seen:]:
            assert self.proc.poll() is None, open(self.log_path).read()[-3000:]
            assert time.time() < deadline, "the rollout server did not become ready"
            time.sleep(0.5)

    def http(
        self, path: str, method: str = "GET", token: str | None = TOKEN, body: bytes | None = None, timeout: float = 30
    ):
        return http(self.url + path, method, token, body, timeout, self.context)

    def signal(self, sig):
        os.killpg(self.proc.pid, sig)

    def stop(self):
        try:
            self.signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def http(
    url: str,
    method: str = "GET",
    token: str | None = TOKEN,
    body: bytes | None = None,
    timeout: float = 30,
    context=None,
    headers: dict | None = None,
):
    headers = dict(headers or {}, **({"Authorization": f"Bearer {token}"} if token is not None else {}))
    if body is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def self_signed(folder: str) -> tuple:
    """A certificate and key for 127.0.0.1 (cert.pem, key.pem in `folder`), valid for a day."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cert_path, key_path

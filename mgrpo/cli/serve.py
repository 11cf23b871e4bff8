"""A guarded vLLM rollout server for `rollout.engine: remote` (see mgrpo/serving/server.py).

    MGRPO_SERVER_TOKEN=... mgrpo-serve --model DIR --port 8000 [--host 127.0.0.1]
    mgrpo-serve --model DIR --port 8000 --token-file /path/token     (the file holds the token)

(`python launch/rollout_server.py ...` from a checkout is the same command.)

The token comes from MGRPO_SERVER_TOKEN or --token-file (one of them, not both; a token file others can read is
refused), never from a flag's value, and is never logged. Every route but GET /health needs `Authorization: Bearer
TOKEN`. Binds 127.0.0.1 unless --host says otherwise; a non-loopback host needs a token and TLS (--ssl-certfile,
--ssl-keyfile: the token would travel in clear otherwise). Prints `ready: http(s)://HOST:PORT` when it serves.
Extra arguments after `--` go to vLLM's own server (e.g. `-- --tensor-parallel-size 8`); --host, --port and --uds
are refused there (they would slip past the loopback check).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys

from mgrpo.cli.dialect import FlagParser
from mgrpo.netutil import is_loopback  # no torch: refusals stay fast

if multiprocessing.parent_process() is not None:  # vLLM's engine core, spawned: it re-imports the launching
    # module and so this one. On CPU the idle busy-polling of vLLM's shared-memory queues is shortened there too
    # (vllm_worker._quiet_idle_spin)
    from mgrpo.serving import vllm_worker  # noqa: F401


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


class TokenError(ValueError):
    """A token source we will not use; the message names it and the fix."""


def read_token(token_file: str | None) -> str | None:
    env = os.environ.get("MGRPO_SERVER_TOKEN", "").strip()
    if env and token_file:
        raise TokenError("both MGRPO_SERVER_TOKEN and --token-file are set; give one of them")
    if env:
        return env
    if token_file:
        fd = os.open(token_file, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            mode = os.fstat(f.fileno()).st_mode
            if mode & 0o077:
                raise TokenError(
                    f"--token-file {token_file} is readable by others (mode {mode & 0o777:o}); chmod 600 it"
                )
            return f.read().strip() or None
    return None


def write_token(path: str, token: str) -> None:
    """A fresh token file, 0600, never through a link: any old file or link at `path` is removed first."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


PASS_THROUGH_REFUSED = ("--host", "--port", "--uds", "--weight-transfer-config")


def main(argv=None) -> int:
    ap = FlagParser("mgrpo-serve", __doc__)
    ap.add_argument("--model", required=True, help="HF model folder")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    ap.add_argument("--token-file", default=None, help="file holding the token (else MGRPO_SERVER_TOKEN)")
    ap.add_argument("--dtype", default="auto", help="auto: float32 on CPU (exact logprobs), bfloat16 on GPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-bucket-mb", type=int, default=4096, help="largest weight bucket accepted")
    ap.add_argument(
        "--max-staged-gb",
        type=float,
        default=None,
        help="bytes staged for one version at most (default: twice the model's size + 64 MB)",
    )
    ap.add_argument(
        "--max-staged-buckets",
        type=int,
        default=None,
        help="buckets staged for one version at most (default: the model's tensor count)",
    )
    ap.add_argument(
        "--update-timeout-s",
        type=float,
        default=600.0,
        help="deadline for pausing generation and loading one update; past it the server is poisoned",
    )
    ap.add_argument("--ssl-certfile", default=None, help="TLS certificate (required off loopback)")
    ap.add_argument("--ssl-keyfile", default=None, help="TLS private key (required off loopback)")
    ap.add_argument(
        "--transport",
        choices=("http", "collective"),
        default="http",
        help="how weights arrive: http buckets (always served) and, with collective, a broadcast into "
        "vLLM's weight-transfer engine over gloo (CPU) or NCCL (GPU)",
    )
    ap.add_argument(
        "--collective-host",
        default="127.0.0.1",
        help="address the collective rendezvous and data connections bind (no authentication on that "
        "plane: keep it on a private network)",
    )
    ap.add_argument(
        "--collective-stream",
        choices=("auto", "on", "off"),
        default="auto",
        help="load each bucket as it arrives (bounded memory; a failure mid-load poisons the server) "
        "instead of staging the whole update first; auto: on with CUDA",
    )
    ap.add_argument(
        "--collective-join-timeout-s",
        type=float,
        default=60.0,
        help="how long the workers wait for the trainer's senders to join a new group",
    )
    ap.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        default="vllm",
        help="the engine behind the guard: vLLM in this process, or SGLang as a loopback child (weights "
        "by collective broadcast only; the vLLM-only flags above do not apply)",
    )
    ap.add_argument(
        "--sglang-url",
        default=None,
        help="with --engine sglang: guard an SGLang server already running on loopback at this URL "
        "(its --admin-api-key in MGRPO_SGLANG_ADMIN_KEY) instead of starting one",
    )
    args, extra = ap.parse_known_args(argv)
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return fail(f"--model {args.model}: no config.json there; give an HF model folder")
    refused = [a.split("=")[0] for a in extra if a.split("=")[0] in PASS_THROUGH_REFUSED]
    if refused:
        return fail(
            f"{refused[0]} after `--` is refused (it would bypass the loopback and TLS checks); give it before `--`"
        )
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        return fail("--ssl-certfile and --ssl-keyfile go together; give both")
    if not is_loopback(args.host) and not args.ssl_certfile:
        return fail(
            f"--host {args.host} is not loopback: serve TLS (--ssl-certfile, --ssl-keyfile), or the token "
            f"travels in clear"
        )
    try:
        token = read_token(args.token_file)
    except TokenError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"--token-file {args.token_file}: cannot read it ({exc.strerror})")
    if token is None:
        if not is_loopback(args.host):
            return fail(
                f"--host {args.host} is not loopback and no token is set; set MGRPO_SERVER_TOKEN or "
                f"--token-file (every route but /health needs it)"
            )
        import secrets

        token = secrets.token_urlsafe(32)
        path = os.path.join(os.path.expanduser("~"), ".cache", "mgrpo", f"rollout-server-{args.port}.token")
        write_token(path, token)
        print(
            f"mgrpo: no token given: a new one is in {path} (clients: MGRPO_SERVER_TOKEN=$(cat {path}))",
            file=sys.stderr,
            flush=True,
        )
    os.environ.pop("MGRPO_SERVER_TOKEN", None)  # vLLM's processes need not see it
    if args.engine == "sglang":
        return serve_sglang(args, extra, token)
    import torch

    from mgrpo.rollout.engines.vllm import in_core_worker_setting

    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if torch.cuda.is_available() else "float32")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", in_core_worker_setting())
    import uvloop

    from mgrpo.serving.server import serve, vllm_args

    tls = ["--ssl-certfile", args.ssl_certfile, "--ssl-keyfile", args.ssl_keyfile] if args.ssl_certfile else []
    collective = None
    if args.transport == "collective":
        from mgrpo.serving.collective_receiver import BACKEND

        collective = dict(
            host=args.collective_host,
            backend="nccl" if torch.cuda.is_available() else "gloo",
            join_timeout_s=args.collective_join_timeout_s,
            stream={"on": True, "off": False}.get(args.collective_stream, torch.cuda.is_available()),
        )
        tls += ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
    vargs = vllm_args(
        os.path.abspath(args.model),
        args.host,
        args.port,
        dtype,
        args.seed,
        args.max_model_len,
        args.max_num_seqs,
        tls + extra,
    )

    def ready(address: str) -> None:
        print(f"ready: {address}", flush=True)

    try:
        uvloop.run(
            serve(
                vargs,
                token,
                args.max_bucket_mb << 20,
                ready,
                update_timeout_s=args.update_timeout_s,
                max_staged_bytes=int(args.max_staged_gb * (1 << 30)) if args.max_staged_gb else None,
                max_staged_buckets=args.max_staged_buckets,
                collective=collective,
            )
        )
    except OSError as exc:
        if exc.errno in (98, 48):  # EADDRINUSE on Linux / macOS
            return fail(f"--port {args.port}: address {args.host}:{args.port} is already in use; pick another port", 1)
        return fail(f"server stopped: {exc}", 1)
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001  (the engine did not start: the model folder, memory, ...)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        return fail(f"--model {args.model}: vLLM could not start on it ({type(exc).__name__}: {first})", 1)
    return 0


def serve_sglang(args, extra: list, token: str) -> int:
    """SGLang behind mgrpo's guard (mgrpo/serving/sglang_guard.py)."""
    import secrets
    import signal

    from mgrpo.netutil import is_loopback_url
    from mgrpo.serving import sglang_guard

    child = None
    if args.sglang_url:
        if not is_loopback_url(args.sglang_url):
            return fail(f"--sglang-url {args.sglang_url} is not on loopback: the guard must be the only way in")
        url, admin_key = args.sglang_url.rstrip("/"), os.environ.pop("MGRPO_SGLANG_ADMIN_KEY", "")
        if not admin_key:
            return fail(
                "--sglang-url needs that server's --admin-api-key in MGRPO_SGLANG_ADMIN_KEY (without one "
                "its weight routes are open to anyone on the host)"
            )
    else:
        admin_key = secrets.token_urlsafe(32)
        try:
            child, url = sglang_guard.start_sglang(os.path.abspath(args.model), admin_key, extra)
        except ValueError as exc:  # the environment: the user's to fix
            return fail(f"--engine sglang: {exc}")
        except Exception as exc:  # noqa: BLE001  (not installed, no GPU kernels, bad model: its own words)
            return fail(f"--engine sglang: SGLang could not start on {args.model}: {exc}", 1)
    try:
        info = sglang_guard.server_info(url, admin_key)
        if int(info.get("pp_size", 1) or 1) > 1:
            return fail(
                "--engine sglang with pipeline parallelism inside SGLang: weight sync is not supported; "
                "use --tp-size only"
            )
        ssl_context = None
        if args.ssl_certfile:
            import ssl

            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        sglang_guard.serve(
            url,
            admin_key,
            token,
            args.host,
            args.port,
            args.model,
            int(info.get("tp_size", 1) or 1),
            ssl_context,
            on_ready=lambda address: print(f"ready: {address}", flush=True),
            child=child,
        )
    except OSError as exc:
        return fail(f"--engine sglang: {exc}", 1)
    finally:
        if child is not None:
            os.killpg(child.pid, signal.SIGTERM)
    return 0


if __name__ == "__main__":
    sys.exit(main())

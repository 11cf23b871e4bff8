"""A stand-in for one vLLM worker of a TP2 engine, for tests/weights/test_shared_memory_workers.py: the real
receiving protocol (`mgrpo/serving/shm_receiver.py`) into a model whose `reload_weights` keeps what it is given.

One JSON command per stdin line ({channel, token, expected, out, delay, fail_after}); one JSON result per stdout
line; the tensors received go to `out` (safetensors). `delay` seconds per tensor make this worker the slow one.
"""

import json
import sys
import time

import torch
from safetensors.torch import save_file

from mgrpo.serving.shm_receiver import receive_weights


class Worker:
    def __init__(self, rank: int):
        self.rank = rank
        self.model_runner = type("Runner", (), {"model": torch.nn.Module()})()
        self.got, self.delay, self.fail_after = {}, 0.0, None

    def reload_weights(self, weights_iterator):
        for i, (name, tensor) in enumerate(weights_iterator):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError(f"worker {self.rank} failed while loading tensor {i}")
            time.sleep(self.delay)
            self.got[name] = tensor.clone()


def main() -> None:
    worker = Worker(int(sys.argv[1]))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        worker.got, worker.delay, worker.fail_after = {}, cmd.get("delay", 0.0), cmd.get("fail_after")
        result = receive_weights(worker, cmd["channel"], cmd["token"], cmd["expected"], [])
        save_file(worker.got, cmd["out"])
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

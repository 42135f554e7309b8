"""``transformers serve`` on kvkernels: OpenAI chat requests (the ``openai`` client) to servers on localhost
ports, from a tiny random Llama saved with an offline word-level tokenizer and a chat template
(tests/hf_models.py: ``save_chat_model``; nothing is downloaded):

- kvkernels: ``python -m kvkernels transformers serve MODEL --continuous-batching --attn-implementation
  kvkernels/flash-attn2-api`` (transformers' CLI with the kernel registered);
- the reference: transformers' own ``transformers serve`` console script, ``--continuous-batching
  --attn-implementation sdpa``;
- kvkernels without continuous batching (the server runs ``generate()`` on the stock cache, through
  ``flash_attn_func`` / ``flash_attn_varlen_func``).

Three concurrent requests per server; every answer equals the reference server's and the greedy
``generate()`` of the same model in this process, and the call logs (``KVKERNELS_FLASH_CALL_LOG``) show
the kernel ran inside the kvkernels servers.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

import kvkernels
from kvkernels.integrations.transformers_flash import KERNEL_NAME

from hf_models import chat_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_PARENT = str(Path(kvkernels.__file__).resolve().parents[1])  # the kvkernels this test imports
# transformers serve takes any Hub-style kernel name from 5.18 on (5.18.0, 5.22.2, 5.23.0 and 5.24.0 run this
# test); 5.16.1's accepts only kernels-community/* names.
MIN_TRANSFORMERS = "5.18.0"
pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < Version(MIN_TRANSFORMERS),
    reason=f"transformers {transformers.__version__}: transformers serve accepts a kernel outside kernels-community "
           f"from {MIN_TRANSFORMERS} on")

MESSAGES = [[{"role": "user", "content": "w10 w11 w12 w40"}],
            [{"role": "system", "content": "w99"}, {"role": "user", "content": "w20 w21"}],
            [{"role": "user", "content": " ".join(f"w{i}" for i in range(30, 60))}]]
MAX_TOKENS = 12
START_TIMEOUT = 180
# Small explicit cache sizes: by default continuous batching sizes its cache from the free memory.
CB_FLAGS = ["--continuous-batching", "--cb-block-size", "16", "--cb-num-blocks", "64", "--cb-max-batch-tokens", "256"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, command: list[str], tmp: Path, call_log: bool):
        self.name, self.port = name, free_port()
        self.log_path, self.calls = tmp / f"{name}.log", (tmp / f"{name}-calls" if call_log else None)
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join([PACKAGE_PARENT, *filter(None, [os.environ.get("PYTHONPATH")])]))
        env.pop("KVKERNELS_FLASH_CALL_LOG", None)
        if self.calls is not None:
            self.calls.mkdir()
            env["KVKERNELS_FLASH_CALL_LOG"] = str(self.calls)
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen([*command, "--port", str(self.port), "--host", "localhost", "--device", "cpu"],
                                        cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def client(self):
        import openai
        return openai.OpenAI(base_url=f"http://localhost:{self.port}/v1", api_key="unused", max_retries=0, timeout=120)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"{self.name} server exited:\n{self.log_path.read_text()}"
            with socket.socket() as s:
                if s.connect_ex(("localhost", self.port)) == 0:
                    return
            time.sleep(0.25)
        raise AssertionError(f"{self.name} server not listening after {START_TIMEOUT} s:\n{self.log_path.read_text()}")

    def chat(self, messages, model: str) -> str:
        response = self.client().chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                         temperature=0.0)
        return response.choices[0].message.content

    def call_lines(self) -> list[str]:
        return [line for f in sorted(self.calls.iterdir()) for line in f.read_text().splitlines()]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def transformers_cli() -> str:
    """transformers' console script (the `transformers` command) next to this interpreter."""
    script = Path(sys.executable).with_name("transformers")
    assert script.exists(), f"no transformers command next to {sys.executable}"
    return str(script)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hf_models import save_chat_model
    return save_chat_model(tmp_path_factory.mktemp("chat-model"))


def expected_answers(model_dir) -> tuple[list[str], list[tuple[int, int]]]:
    """Greedy generate() of the saved model with SDPA and the stock cache, decoded as the server does;
    and each request's (prompt tokens, generated tokens)."""
    tokenizer = chat_tokenizer()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    answers, lengths = [], []
    for messages in MESSAGES:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)  # stops at </s>, as the server
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        lengths.append((ids.shape[1], out.shape[1] - ids.shape[1]))
    return answers, lengths


def test_serve_continuous_batching_on_kvkernels(model_dir, tmp_path):
    kvk = [sys.executable, "-m", "kvkernels", "transformers", "serve", str(model_dir), "--attn-implementation",
           KERNEL_NAME]
    servers = [Server("kvkernels-cb", [*kvk, *CB_FLAGS], tmp_path, call_log=True),
               Server("sdpa-cb", [transformers_cli(), "serve", str(model_dir), "--attn-implementation", "sdpa",
                                  *CB_FLAGS], tmp_path, call_log=False),
               Server("kvkernels-generate", kvk, tmp_path, call_log=True)]
    try:
        expected, lengths = expected_answers(model_dir)  # while the servers start
        for server in servers:
            server.wait_ready()
        answers = {}
        with concurrent.futures.ThreadPoolExecutor(len(MESSAGES)) as pool:
            for server in servers:  # the requests of one server concurrently: continuous batching batches them
                answers[server.name] = list(pool.map(lambda m, s=server: s.chat(m, str(model_dir)), MESSAGES))
    finally:
        for server in servers:
            server.stop()
    assert all(len(a.split()) >= 4 for a in expected) and len(set(expected)) == len(expected), expected
    assert answers["sdpa-cb"] == expected
    assert answers["kvkernels-cb"] == expected
    assert answers["kvkernels-generate"] == expected
    # The kernel ran in the kvkernels servers, for every token: with continuous batching the varlen
    # function (each request's prompt, then one query row per step after its first token), without it
    # generate() per request (the dense function: one call per layer and generated token).
    layers = transformers.AutoConfig.from_pretrained(model_dir).num_hidden_layers
    cb = [line.split() for line in servers[0].call_lines()]
    assert {name for name, _, _ in cb} == {"flash_attn_varlen_func"}
    assert sum(int(rows) for _, _, rows in cb) == layers * sum(p + n - 1 for p, n in lengths), cb
    generate = [line.split() for line in servers[2].call_lines()]
    assert len(generate) == layers * sum(n for _, n in lengths) and {name for name, _, _ in generate} == {
        "flash_attn_func"}, generate

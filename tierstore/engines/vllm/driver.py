"""A vLLM engine in a child process, driven over its stdin and stdout.

Provides:
- ``tiny_llama(path, ...)``: save a random-weight Llama built from a config
  (nothing is downloaded) for vLLM to load; ``WIDE_KV``: its arguments for
  an 8B model's KV per token; ``chat_tokenizer(path, vocab)``: save beside
  it a word-level tokenizer (``w0 w1 ...``: one token a word, so a prompt's
  length in tokens is its length in words) with a chat template, for the
  OpenAI server's text and chat endpoints.
- ``kv_transfer_config(socket_path, **settings)``: the TierstoreConnector's
  ``kv_transfer_config``.
- ``VllmEngine``: starts ``python -m tierstore.engines.vllm.driver`` with a
  model, an optional connector and more ``LLM`` arguments, and sends it
  requests: ``generate`` (greedy; token ids, ``num_cached_tokens`` and the
  call's time per prompt), ``reset_prefix_cache`` (vLLM's own cache of this
  engine; not the store), ``histograms`` (the count and sum of vLLM's
  Prometheus histograms by name, e.g. the connector's
  ``vllm:tierstore_load_seconds``; needs ``disable_log_stats=False`` in the
  ``LLM`` arguments) and ``close``. ``python``: another interpreter for
  the child (a virtualenv with vLLM and another connector; the child
  imports nothing of tierstore beyond this module, so ``PYTHONPATH`` to the
  repository is enough). Every wait has a deadline; an engine that dies or
  stalls raises ``EngineError`` with the tail of its log.

Fresh engine processes are what "warm from another process" means, and vLLM
wants its ``LLM`` built under a ``__main__`` guard: the child is that
``__main__``. Used by the tests, ``bench/engines/vllm_kv.py`` and ``tierstore demo
--engine vllm``. The parent side imports neither vLLM nor torch.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPLY = "@@tierstore-driver "
DEFAULT_START_TIMEOUT_S = 300.0


class EngineError(RuntimeError):
    """The engine child failed, exited or did not answer in time."""


@dataclass(frozen=True, slots=True)
class Output:
    token_ids: list[int]
    num_cached_tokens: int


# The connector's histogram of its loads' seconds (tierstore.engines.vllm.metrics, which
# imports vLLM: this module must not), for ``VllmEngine.histograms``.
LOAD_SECONDS = "vllm:tierstore_load_seconds"


@dataclass(frozen=True, slots=True)
class Histo:
    """A histogram's observations so far: how many, and their sum."""

    count: int
    sum: float


def tiny_llama(
    path: str | os.PathLike[str],
    *,
    num_layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int = 1024,
    max_positions: int = 16384,
    seed: int = 0,
) -> Path:
    """A random-weight bf16 Llama (4 layers, hidden 256, 4 heads, 2 KV heads
    of ``hidden // heads`` by default; ``intermediate`` 2x hidden) saved with
    ``save_pretrained``; returns its directory. ``head_dim`` decouples the
    heads from ``hidden`` (LlamaConfig's ``head_dim``): an 8B model's KV per
    token with CPU-sized compute (``WIDE_KV``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,  # None: hidden // heads
        max_position_embeddings=max_positions,
        initializer_range=0.1,  # 0.02 makes a random Llama repeat one token
        torch_dtype="bfloat16",
    )
    model: Any = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


CHAT_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def chat_tokenizer(path: str | os.PathLike[str], vocab: int = 1024) -> Path:
    """Save a tokenizer of ``vocab`` ids into ``path`` (beside a ``tiny_llama``
    of the same vocabulary): the special tokens, then the words ``w0``,
    ``w1``, ... split on white space; a chat renders as ``<s><|user|> text
    <|end|> ... <|assistant|>``. Returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if (path / "tokenizer.json").exists():
        return path
    words = {t: i for i, t in enumerate(CHAT_SPECIAL_TOKENS)}
    words.update({f"w{i}": len(CHAT_SPECIAL_TOKENS) + i for i in range(vocab - len(words))})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    # The chat markers are special added tokens, as a real model's are: the
    # tokenizer splits its input at them first (the gateway's cache of
    # tokenized prompt prefixes cuts there).
    fast.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIAL_TOKENS[3:])})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


WIDE_KV: dict[str, int] = {
    "num_layers": 24, "hidden": 256, "heads": 8, "kv_heads": 8, "head_dim": 128,
    "intermediate": 512,
}  # fmt: skip
"""``tiny_llama`` arguments for an 8B model's KV per token (Llama-3-8B: 8 KV
heads of 128; 24 of its 32 layers): 96 KiB a token in bf16, 12 MiB a
128-token block, with the compute of a 256-wide model."""


def kv_transfer_config(socket_path: str | os.PathLike[str], **settings: Any) -> dict[str, Any]:
    return {
        "kv_connector": "TierstoreConnector",
        "kv_connector_module_path": "tierstore.engines.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # vLLM's default fails the request
        "kv_connector_extra_config": {"socket_path": str(socket_path), **settings},
    }


def example_transfer_config(storage_path: str | os.PathLike[str]) -> dict[str, Any]:
    """vLLM's reference ExampleConnector (safetensors files), for comparison."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_path)},
    }


class VllmEngine:
    """See the module docstring. Use as a context manager or call ``close``."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        kv_transfer: dict[str, Any] | None = None,
        *,
        enforce_eager: bool = True,
        log_path: str | os.PathLike[str] | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        env: dict[str, str] | None = None,
        llm_kwargs: dict[str, Any] | None = None,
        python: str | os.PathLike[str] | None = None,
        in_process: bool = False,
    ) -> None:
        """``in_process``: vLLM's engine core and its one worker in the
        child's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
        ``uni`` executor) instead of two more processes that import vLLM
        again: about 10 s to start here instead of 26. The connector's two
        roles then share that process; a server (``api_server``) or
        ``tensor_parallel_size > 1`` keeps them apart. vLLM's worker
        processes get ``OMP_NUM_THREADS`` from their core binding (one core
        with the reservation below, on 2 cores): the in-process one is given
        the same count, as the thread count changes bf16 sums and so greedy
        ids (measured: a warm 8B-KV prompt differed from cold at token 16
        with 2 threads)."""
        if in_process:
            llm_kwargs = {"distributed_executor_backend": "uni", **(llm_kwargs or {})}
            threads = str(max(1, (os.cpu_count() or 2) - 1))
            env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": threads,
                   **(env or {})}  # fmt: skip
        args = [
            str(python or sys.executable),
            "-m",
            "tierstore.engines.vllm.driver",
            "--model",
            str(model),
        ]
        if kv_transfer is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer)]
        if llm_kwargs:
            args += ["--llm-kwargs", json.dumps(llm_kwargs)]
        if enforce_eager:
            args.append("--enforce-eager")
        child_env = dict(os.environ, **(env or {}))
        child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM-CPU reserves one more core for the scheduler when kv_transfer_config is set
        # (vllm/utils/ompmultiprocessing.py): engines with and without a connector would
        # run on different OpenMP thread counts, which changes both the prefill time and,
        # through another reduction order, the greedy ids. One reservation for every engine.
        child_env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        self._log_tail: deque[str] = deque(maxlen=60)
        self._log_file: IO[str] | None = open(log_path, "a") if log_path else None
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env,
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="vllm-driver-out", daemon=True)
        self._reader.start()
        self.start_s = self._reply(start_timeout_s)["start_s"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self._replies.put(json.loads(line[len(REPLY) :]))
                continue
            self._log_tail.append(line)
            if self._log_file is not None:
                self._log_file.write(line)
                self._log_file.flush()
        self._replies.put(None)

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            self.proc.kill()
            raise EngineError(f"no answer within {timeout_s}s:\n{self.log_tail()}") from None
        if reply is None:
            self.proc.wait(30)
            raise EngineError(f"engine exited {self.proc.returncode}:\n{self.log_tail()}")
        if "error" in reply:
            raise EngineError(f"engine failed: {reply['error']}\n{self.log_tail()}")
        return reply

    def log_tail(self) -> str:
        return "".join(self._log_tail)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 8,
        *,
        session: str = "",
        ignore_eos: bool = False,
        timeout_s: float = 300.0,
    ) -> tuple[list[Output], float]:
        """Greedy outputs of ``prompts`` (one batch) and the call's seconds.
        ``ignore_eos``: always ``max_tokens`` tokens (a comparison's length)."""
        cmd = {
            "op": "generate",
            "prompts": prompts,
            "max_tokens": max_tokens,
            "session": session,
            "ignore_eos": ignore_eos,
        }
        reply = self._command(cmd, timeout_s)
        outs = [Output(o["token_ids"], o["num_cached_tokens"]) for o in reply["outputs"]]
        return outs, float(reply["seconds"])

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> bool:
        """Empty this engine's own prefix cache (``LLM.reset_prefix_cache``),
        so that later prompts are computed again. False when vLLM refused
        (it does while requests hold blocks)."""
        return bool(self._command({"op": "reset_prefix_cache"}, timeout_s)["reset"])

    def histograms(self, prefix: str = "vllm:", timeout_s: float = 60.0) -> dict[str, Histo]:
        """vLLM's histograms whose name starts with ``prefix``, each summed
        over its labels (an engine started without ``disable_log_stats=False``
        has none)."""
        reply = self._command({"op": "histograms", "prefix": prefix}, timeout_s)
        return {name: Histo(int(c), float(s)) for name, (c, s) in reply["histograms"].items()}

    def _command(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise EngineError(f"engine is gone:\n{self.log_tail()}") from None
        return self._reply(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout_s)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(30)
        self._reader.join(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the child ---------------------------------------------------------------------------


def _send(obj: dict[str, Any]) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _child(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="tierstore.engines.vllm.driver")
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-transfer-config", default="")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--llm-kwargs", default="", help="more LLM(...) arguments, as JSON")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = json.loads(args.llm_kwargs) if args.llm_kwargs else {}
    if args.kv_transfer_config:
        kwargs["kv_transfer_config"] = json.loads(args.kv_transfer_config)
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enable_prefix_caching=True,
        enforce_eager=args.enforce_eager,
        **kwargs,
    )
    # The first request of an eager engine can differ from later ones: warm up.
    warm = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False)
    warm_up: Any = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}]
    llm.generate(warm_up, warm, use_tqdm=False)
    _send({"start_s": time.perf_counter() - t0})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "close":
            break
        if cmd["op"] == "reset_prefix_cache":
            _send({"reset": bool(llm.reset_prefix_cache())})
            continue
        if cmd["op"] == "histograms":
            _send({"histograms": _histograms(llm, cmd["prefix"])})
            continue
        params = SamplingParams(
            max_tokens=cmd["max_tokens"],
            temperature=0.0,
            ignore_eos=bool(cmd.get("ignore_eos", False)),
            detokenize=False,
            extra_args={"kv_transfer_params": {"session": cmd["session"]}}
            if cmd.get("session")
            else None,
        )
        t = time.perf_counter()
        batch: Any = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        _send(
            {
                "seconds": seconds,
                "outputs": [
                    {
                        "token_ids": list(o.outputs[0].token_ids),
                        "num_cached_tokens": int(o.num_cached_tokens or 0),
                    }
                    for o in outs
                ],
            }
        )


def _histograms(llm: Any, prefix: str) -> dict[str, tuple[int, float]]:
    from vllm.v1.metrics.reader import Histogram

    out: dict[str, tuple[int, float]] = {}
    for m in llm.get_metrics():
        if isinstance(m, Histogram) and m.name.startswith(prefix):
            count, total = out.get(m.name, (0, 0.0))
            out[m.name] = (count + m.count, total + m.sum)
    return out


if __name__ == "__main__":
    try:
        _child(sys.argv[1:])
    except Exception as e:  # the parent gets the failure, not a silent exit
        _send({"error": f"{type(e).__name__}: {e}"})
        raise

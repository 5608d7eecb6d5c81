"""The gateway's tokenization prefix cache gives the ids a whole encode gives,
turn after turn of a chat, on the word-level tokenizer of the benches and on
a byte-level BPE with a Llama-3-style template, while encoding only the new
part (hits counted); splicing at a cut that is not a special token differs
(the negative control: the oracle can fail)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tierstore.engines.vllm.driver import chat_tokenizer
from tierstore.gateway.prefix_tokens import PrefixTokens

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def bpe_tokenizer() -> Any:
    rng = np.random.default_rng(3)
    words = ["def", "return", "self", "the", "of", "x", "=", "(", ")", ":", "\n", "  ", "if"]
    corpus = [" ".join(rng.choice(words, 40)) + "\n\n" for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>")  # fmt: skip
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    fast.chat_template = LLAMA3_TEMPLATE
    return fast


def chats(rng: np.random.Generator, words: list[str], users: int, turns: int) -> list[list[str]]:
    """Each user's rendered prompts are made by the caller; here, message texts."""
    return [[" ".join(rng.choice(words, int(rng.integers(5, 60)))) for _ in range(2 * turns + 1)]
            for _ in range(users)]  # fmt: skip


def check(tok: Any, words: list[str]) -> tuple[int, int]:
    cache = PrefixTokens(tok.backend_tokenizer, tok.added_tokens_decoder)
    rng = np.random.default_rng(11)
    compared = 0
    for texts in chats(rng, words, users=6, turns=5):
        messages = [{"role": "system", "content": texts[0]}]
        for t in range(5):
            messages.append({"role": "user", "content": texts[1 + 2 * t]})
            prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            whole = tok.backend_tokenizer.encode(prompt, add_special_tokens=False).ids
            assert cache.encode(prompt) == whole
            compared += len(whole)
            messages.append({"role": "assistant", "content": texts[2 + 2 * t]})
    assert cache.hits >= 6 * 4 and cache.unmatched == 0  # every later turn of every chat
    return compared, cache.hits


def test_the_word_tokenizer_of_the_benches(tmp_path: Path) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(str(chat_tokenizer(tmp_path)))
    compared, _ = check(tok, [f"w{i}" for i in range(1000)])
    assert compared > 3000


def test_a_byte_level_bpe_with_a_llama3_template() -> None:
    tok = bpe_tokenizer()
    words = ["def", "return", "self", "the", "of", "x", "=", "(", ")", ":", "\n", "if", "élan"]
    compared, _ = check(tok, words)
    assert compared > 3000


def test_splicing_at_a_plain_word_boundary_differs() -> None:
    tok = bpe_tokenizer()
    text = "return self of the x"
    backend = tok.backend_tokenizer
    whole = backend.encode(text, add_special_tokens=False).ids
    cut = 3  # inside "return", a merged token
    spliced = (backend.encode(text[:cut], add_special_tokens=False).ids
               + backend.encode(text[cut:], add_special_tokens=False).ids)  # fmt: skip
    assert spliced != whole

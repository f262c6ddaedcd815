"""Small byte-level tokenizers built offline in a family's chat style, for the stand-in checkpoints and tests.

They are written as ordinary HF tokenizer files, so `corl_jax.tokenization.load_tokenizer` reads them back like a
real model's.
"""

from __future__ import annotations

import os
from typing import Literal, Sequence

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

_STYLES = {
    # Qwen-like: ChatML turns, no BOS, eos = end of turn, pad = end of text.
    "chatml": dict(
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>",
        template=("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                  "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")),
    # Llama-3-like: header turns, BOS written by the template and by the post-processor, no pad.
    "llama3": dict(
        special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
        template=("{{ bos_token }}{% for message in messages %}<|start_header_id|>"
                  "{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
                  "{% endfor %}{% if add_generation_prompt %}"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")),
}


def build_tokenizer(directory: str | os.PathLike, kind: Literal["char", "bpe"], *,
                    style: Literal["chatml", "llama3"] = "chatml",
                    corpus: Sequence[str] | None = None, vocab_size: int = 512, digit_group: int = 1,
                    chat_template: bool = True):
    """Writes a small byte-level tokenizer that ``load_tokenizer`` reads back, and returns it.

    ``kind="char"``: every byte is a token (so is every printable ASCII character), no merges.
    ``kind="bpe"``: byte-level BPE trained on ``corpus`` up to ``vocab_size`` tokens.
    Numbers are pre-split into groups of at most ``digit_group`` digits: 1 splits digits one by one
    (as Qwen's tokenizers do), 3 keeps up to three digits together (as Llama 3's do; BPE may then
    learn whole numbers); 0 does not split them, so BPE may learn a number with its leading space as
    one token (as GPT-2's does). ``style`` picks the special tokens and chat template of a family;
    ``chat_template=False`` leaves the template out.
    """
    spec = _STYLES[style]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if kind == "char":
        vocab = {token: i for i, token in enumerate(spec["special"] + alphabet)}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    elif kind == "bpe":
        if not corpus:
            raise ValueError("build_tokenizer(kind='bpe') needs a non-empty corpus to train on")
        tokenizer = Tokenizer(models.BPE())
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; use 'char' or 'bpe'")
    if digit_group not in (0, 1, 2, 3):
        raise ValueError(f"digit_group={digit_group}; use 1 (single digits), 2 or 3 (Llama-3-style groups) "
                         "or 0 (numbers not split: GPT-2 style)")
    digit_split = [pre_tokenizers.Split(Regex(rf"\d{{1,{digit_group}}}"), behavior="isolated")] if digit_group else []
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*digit_split, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    if kind == "bpe":
        tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=spec["special"], initial_alphabet=alphabet,
            show_progress=False))
    tokenizer.add_special_tokens(spec["special"])
    if spec["bos"] is not None:
        bos_id = tokenizer.token_to_id(spec["bos"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{spec['bos']} $A", pair=f"{spec['bos']} $A {spec['bos']} $B",
            special_tokens=[(spec["bos"], bos_id)])
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=spec["bos"], eos_token=spec["eos"],
        pad_token=spec["pad"], chat_template=spec["template"] if chat_template else None)
    hf_tokenizer.save_pretrained(str(directory))
    return hf_tokenizer

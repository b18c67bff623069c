"""What a new user meets first: `remat: auto`'s default budget on a CPU, a TRL config, the merged export's
generation defaults, chat content that is not a string, prompts longer than the context, and every bad record
named at once."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxft.memory import GIB, STREAMED, MemoryBudgetError, default_memory_budget, host_available_memory
from jaxft.memory.execution import ExecutionConfig
from jaxft.lora import LoraConfig
from jaxft.memory.policy import parse
from jaxft.run import Run
from test_train_fixtures import make_tiny_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY_LLAMA = EXAMPLES / "tiny-llama"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("user") / "model", hidden=64, layers=2)


# ------------------------------------------------------------------------------------------ remat auto on a CPU
def _meminfo(path: Path, *, total: float, free: float, available: float) -> Path:
    """A /proc/meminfo of a host whose page cache holds what MemFree lacks (sizes in GiB)."""
    kb = lambda gib: int(gib * GIB // 1024)  # noqa: E731
    path.write_text(f"MemTotal:       {kb(total)} kB\nMemFree:        {kb(free)} kB\n"
                    f"MemAvailable:   {kb(available)} kB\nBuffers:           52776 kB\n"
                    f"Cached:         {kb(available - free)} kB\n")
    return path


def _no_cgroup(tmp_path: Path) -> dict:
    return dict(cgroup_root=tmp_path / "no-cgroup", proc_cgroup=tmp_path / "no-cgroup-file")


def test_the_cpu_budget_is_memavailable_not_memfree(tmp_path):
    """MemFree 0.1 GiB beside MemAvailable 12 GiB (a page cache of 11.9 GiB): the budget is MemAvailable less
    the 1 GiB margin, where the free pages gave -0.9 GiB; 8 CPU devices of one process share it."""
    meminfo = _meminfo(tmp_path / "meminfo", total=16, free=0.1, available=12)
    available, what = host_available_memory(meminfo, **_no_cgroup(tmp_path))
    assert available == 12 * GIB and what == "MemAvailable 12.00 GiB of MemTotal 16.00 GiB"
    cpu = jax.devices("cpu")[0]
    budget, source = default_memory_budget(cpu, host=(available, what))
    assert budget == 11 * GIB and source.startswith("host available memory: MemAvailable 12.00 GiB")
    shared, source = default_memory_budget(cpu, sharing=8, host=(available, what))
    assert shared == 11 * GIB // 8 and source.endswith("split over 8 CPU devices")


def test_a_cgroup_limit_caps_the_host_memory(tmp_path):
    """A container's cgroup allows less than the host has: its limit less what it uses (its inactive page cache,
    which the kernel drops first, not counted), in cgroup v2 and v1."""
    meminfo = _meminfo(tmp_path / "meminfo", total=64, free=1, available=60)
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text(f"{8 * GIB}\n")
    (v2 / "job" / "memory.current").write_text(f"{5 * GIB}\n")
    (v2 / "job" / "memory.stat").write_text(f"anon {2 * GIB}\ninactive_file {2 * GIB}\nactive_file {GIB}\n")
    (tmp_path / "cgroup2").write_text("0::/job\n")
    available, what = host_available_memory(meminfo, v2, tmp_path / "cgroup2")
    assert available == 5 * GIB and what.startswith("cgroup limit 8.00 GiB less 3.00 GiB in use; MemAvailable 60")
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)  # the process's group is not mounted (a container): the mount's root holds the limit
    (v1 / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{3 * GIB}\n")
    (v1 / "memory.stat").write_text(f"cache {2 * GIB}\ntotal_inactive_file {GIB}\n")
    (tmp_path / "cgroup1").write_text("5:devices:/\n4:memory:/process_api/abc\n0::/\n")
    assert host_available_memory(meminfo, tmp_path / "v1", tmp_path / "cgroup1")[0] == 2 * GIB
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert host_available_memory(meminfo, tmp_path / "v1", tmp_path / "cgroup1")[0] == 60 * GIB


def _batch(vocab: int, b: int = 2, t: int = 128) -> dict[str, np.ndarray]:
    """[b, t] rows of two documents, loss on their next tokens."""
    ids = np.random.default_rng(0).integers(0, vocab, (b, t)).astype(np.int32)
    seg = np.repeat(np.concatenate([np.full(t // 2, 1), np.full(t - t // 2, 2)])[None], b, 0).astype(np.int32)
    pos = np.repeat(np.concatenate([np.arange(t // 2), np.arange(t - t // 2)])[None], b, 0).astype(np.int32)
    mask = (np.roll(seg, -1, 1) == seg).astype(np.float32)
    mask[:, -1] = 0
    return dict(input_ids=ids, targets=np.roll(ids, -1, 1), loss_mask=mask, segment_ids=seg, positions=pos)


def _run_on_host(model_dir: Path, meminfo: Path, tmp_path: Path) -> Run:
    """A `remat: auto` run with the default budget, on a host whose memory reads as `meminfo` says."""

    class OnHost(Run):
        def _host_memory(self):
            return host_available_memory(meminfo, **_no_cgroup(tmp_path))

    return OnHost(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32",
                  execution=ExecutionConfig(attention_implementation="reference", remat="auto"))


def test_remat_auto_trains_where_memfree_is_far_below_memavailable(model_dir, tmp_path):
    """The host of the report: free pages below the step's estimate, gigabytes available. auto plans in
    MemAvailable, chooses no remat and the step trains; no host-offloading candidate is offered on a CPU."""
    meminfo = _meminfo(tmp_path / "meminfo", total=16, free=0.01, available=12)
    run, lines = _run_on_host(model_dir, meminfo, tmp_path), []
    batch = _batch(run.model_config.vocab_size)
    assert run.choose_remat(batch, log=lines.append) == "none"
    assert lines[0].startswith("remat auto: device budget 11.00 GiB (host available memory: MemAvailable 12.00 GiB")
    assert "offload" not in lines[0].split("candidates in order of expected speed: ")[1].split(" (")[0]
    assert lines[1].endswith("fits: chosen")
    run.load()
    assert np.isfinite(float(run.step(batch, 0)["loss"]))


def test_a_default_budget_nothing_fits_refuses_in_one_line_without_host_candidates(model_dir, tmp_path):
    """Available memory just over the margin: a positive budget above the weights that no candidate fits. Only
    candidates that keep everything in the device's memory are compiled (no offload, no streamed weights: the
    device is the host), and the refusal names the memory it read and what to do, not a key never written."""
    run = _run_on_host(model_dir, tmp_path / "meminfo", tmp_path)
    weights = run.streamed_weight_bytes()
    _meminfo(tmp_path / "meminfo", total=16, free=0.01, available=1 + 1.5 * weights / GIB)
    with pytest.raises(MemoryBudgetError) as info:
        run.choose_remat(_batch(run.model_config.vocab_size), log=lambda line: None)
    assert run.trials.estimates and all(not parse(name.split(" on ")[0]).offloads and STREAMED not in name
                                       for name in run.trials.estimates)
    text = str(info.value)
    assert text.startswith("no remat policy fits in ") and "(host available memory: MemAvailable 1.00 GiB" in text
    assert "set max_memory_gb" in text and "\n" not in text and info.value.field == "max_memory_gb"


def test_a_default_budget_refusal_reaches_the_user_without_the_key():
    """jaxft-train states a run's execution errors under their config key; a default budget's refusal, about
    no key the user wrote, stays as it is. One the user's max_memory_gb caused keeps the key."""
    from jaxft.train.keys import part_error

    assert str(part_error(MemoryBudgetError("no remat policy fits in ...", keyed=False), "memory")) == \
        "no remat policy fits in ..."
    assert str(part_error(MemoryBudgetError("no remat policy fits in ...", keyed=True), "memory")) == \
        "key 'max_memory_gb': no remat policy fits in ..."


def test_a_default_budget_below_zero_refuses_before_compiling(model_dir, tmp_path):
    """Less available than the margin: nothing can fit, said at once (no candidate compiled) with the numbers."""
    run = _run_on_host(model_dir, _meminfo(tmp_path / "meminfo", total=16, free=0.01, available=0.5), tmp_path)
    with pytest.raises(MemoryBudgetError) as info:
        run.choose_remat(_batch(run.model_config.vocab_size), log=lambda line: None)
    assert run.trials.compiles == [] and run.trials.estimates == {}
    assert str(info.value).startswith("the memory left for the step is -0.500 GiB per device (host available "
                                      "memory: MemAvailable 0.50 GiB of MemTotal 16.00 GiB, less max(1 GiB, 5%))")


# ------------------------------------------------------------------------------------------ a TRL user's config
def _save_to_disk(directory: Path, field: str, texts: list[str]) -> Path:
    """A `datasets` `Dataset.save_to_disk` directory (state.json + one Arrow stream), written with pyarrow."""
    import pyarrow as pa

    directory.mkdir(parents=True)
    table = pa.table({field: texts, "id": list(range(len(texts)))})
    with pa.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                      "_split": "train"}))
    return directory


def test_a_trl_sft_command_line_runs_without_a_yaml(tmp_path, capsys, caplog):
    """`trl sft`'s way: no YAML, TRL's keys on the command line. dataset_name is a save_to_disk directory whose
    text is in the field dataset_text_field names; torch_dtype float32 is bf16 false; eval_strategy / save_strategy
    no: neither evaluation nor checkpoints, though an eval set is given; attn_implementation and the bare
    --use_peft are each named in one line as ignored, with the reason."""
    from jaxft.cli import main

    data = _save_to_disk(tmp_path / "ds", "body", [f"the {w} sat on the mat number {i}" for i, w in
                                                     enumerate(["cat", "dog", "owl", "fox"] * 6)])
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="jaxft"):
        code = main(["--model_name_or_path", str(TINY_LLAMA), "--dataset_name", str(data), "--dataset_text_field",
                     "body", "--eval_dataset", str(data), "--output_dir", str(out), "--torch_dtype", "float32",
                     "--attn_implementation", "sdpa", "--use_peft", "--eval_strategy", "no", "--save_strategy", "no",
                     "--max_length", "64", "--per_device_train_batch_size", "2", "--max_steps", "2",
                     "--report_to", "none", "--disable_tqdm"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["dataset"] == str(data) and saved["dataset_text_field"] == "body" and saved["bf16"] is False
    ignored = [line for line in captured.err.splitlines() if "ignored: " in line]
    assert ignored == ["[jaxft] command line: ignored: attn_implementation 'sdpa': jaxft chooses its own attention "
                       "kernel; its key is attention_implementation (auto, xla, pallas, cudnn)",
                       "[jaxft] command line: ignored: use_peft True: true is jaxft's default, finetuning_type: "
                       "lora (a PEFT adapter); false is read as finetuning_type: full"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not any("eval_loss" in m or "checkpoint" in m for m in metrics)
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and "trained 2 steps" in captured.out


def _yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_trl_keys_in_a_yaml_and_what_cannot_be_honoured(tmp_path):
    """A config written for TRL's SFT: its keys mean what TRL says they mean; those that ask for what jaxft does
    not do are one error each, naming the file, the line and the fix."""
    from jaxft.train import TrainConfigError, load_config

    data = str(EXAMPLES / "data" / "train.jsonl")
    head = f"model_name_or_path: {TINY_LLAMA}\ndataset_name: {data}\noutput_dir: {tmp_path / 'out'}\n"
    cfg = load_config(_yaml(tmp_path / "trl.yaml", head + "dtype: bfloat16\neval_strategy: epoch\n"
                            "save_strategy: steps\nuse_peft: true\nattn_implementation: flash_attention_2\n"
                            "max_length: 256\n"))
    assert (cfg.data.dataset, cfg.model.bf16, cfg.logging.eval_strategy, cfg.logging.save_strategy,
            cfg.model.max_seq_length) == (data, True, "epoch", "steps", 256)
    auto = load_config(_yaml(tmp_path / "auto.yaml", head + "torch_dtype: auto\nbf16: false\nsave_strategy: no\n"))
    assert auto.model.bf16 is False and auto.logging.save_strategy == "no"  # YAML's unquoted no (false) is the strategy "no"
    assert load_config(_yaml(tmp_path / "full.yaml", head + "use_peft: false\n")).lora.finetuning_type == "full"
    for text, message in (
            ("use_peft: false\nfinetuning_type: lora\n", "trl.yaml:4: key 'use_peft': false means finetuning_type: "
                                                         "full, which contradicts finetuning_type: lora"),
            ("torch_dtype: float16\n", "trl.yaml:4: key 'torch_dtype': value 'float16' is not one of 'bfloat16', "
                                       "'float32', 'auto'"),
            ("dtype: float32\nbf16: true\n", "trl.yaml:4: key 'dtype': 'float32' contradicts bf16: True"),
            ("save_strategy: best\n", "trl.yaml:4: key 'save_strategy': value 'best' is not one of 'steps', "
                                      "'epoch', 'no'")):
        with pytest.raises(TrainConfigError) as info:
            load_config(_yaml(tmp_path / "trl.yaml", head + text))
        assert str(info.value).startswith(str(tmp_path / message.split(":")[0]) + message[len("trl.yaml"):])


def test_evaluation_and_checkpoints_follow_their_strategy():
    """steps: every eval_steps / save_steps; epoch: at each epoch's end; no: never; steps and epoch at the end."""
    from jaxft.train.sections import LoggingSection

    log = LoggingSection(output_dir="out", eval_steps=4, save_steps=6, eval_strategy="epoch", save_strategy="steps")
    assert [s for s in range(1, 13) if log.due("eval", s, 11, 5)] == [5, 10, 11]
    assert [s for s in range(1, 13) if log.due("save", s, 11, 5)] == [6, 11, 12]
    never = LoggingSection(output_dir="out", eval_strategy="no", save_strategy="no")
    assert not any(never.due(what, s, 11, 5) for what in ("eval", "save") for s in range(1, 12))


# ------------------------------------------------------------------------------------------ merged export
def _hf_generate(model_dir: Path, prompt: list[int], **kwargs) -> list[int]:
    """transformers' greedy generate with the directory's own defaults (generation_config.json where there is one)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             **kwargs)
    return out[0, len(prompt):].tolist()


def test_a_merged_model_stops_where_its_base_does(model_dir, tmp_path):
    """A base whose generation_config.json alone lists a second stop id (an instruct model's end of turn) and
    its max_new_tokens: transformers stops the base there. A merged export (zero LoRA: the same weights) stops
    at the same token, from jaxft.save_pretrained and from the training run's export (Run.export_merged); without
    the file it would run on to transformers' default length."""
    import shutil

    import jaxft

    prompt = [1, 17, 30, 45, 9, 12]
    free = _hf_generate(model_dir, prompt, max_new_tokens=30, min_new_tokens=30)  # no stop: where would it go
    at = next(i for i in range(3, 30) if free[i] not in free[:i])
    base_dir = shutil.copytree(model_dir, tmp_path / "base")
    eos = json.loads((base_dir / "config.json").read_text())["eos_token_id"]
    assert free[at] != eos
    (base_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos, free[at]], "max_new_tokens": 30, "do_sample": False}))
    base = _hf_generate(base_dir, prompt)
    assert base == free[:at + 1]
    merged = jaxft.save_pretrained(jaxft.from_pretrained(base_dir, dtype="float32"), tmp_path / "merged")
    assert _hf_generate(merged, prompt) == base
    run = Run(base_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32",
              execution=ExecutionConfig(attention_implementation="reference", remat="none"))
    run.load()
    assert _hf_generate(run.export_merged(tmp_path / "from-run"), prompt) == base
    tiny = jaxft.save_pretrained(jaxft.from_pretrained(TINY_LLAMA, dtype="float32"), tmp_path / "tiny")
    assert (tiny / "generation_config.json").read_text() == (TINY_LLAMA / "generation_config.json").read_text()


# ------------------------------------------------------------------------------------------ chat content
@pytest.fixture(scope="module")
def formatter():
    from jaxft.data.formatting import Formatter, load_tokenizer

    return Formatter(load_tokenizer(TINY_LLAMA))


def _chat(content) -> list[dict]:
    return [{"role": "user", "content": content}, {"role": "assistant", "content": "fine"}]


def test_text_parts_train_as_their_joined_text(formatter):
    """OpenAI-style parts on a text model: the text parts joined, as transformers' multimodal templates join
    them, not the list's Python repr that a text-only template would render."""
    from jaxft.data.sources import Record

    parts = formatter(Record({"messages": _chat([{"type": "text", "text": "yo"}, {"type": "text", "text": " there"}])},
                             "chats.jsonl:1"))
    plain = formatter(Record({"messages": _chat("yo there")}, "chats.jsonl:2"))
    assert parts.tokens.tolist() == plain.tokens.tolist() and parts.loss_mask.tolist() == plain.loss_mask.tolist()


@pytest.mark.parametrize("content, problem", [
    ({"a": 1}, 'messages[0].content (role \'user\') is dict {"a": 1}; give a string, or a list of {"type": "text", '
               '"text": ...} (and {"type": "image", "image": path}) parts; fix the record'),
    (123, "messages[0].content (role 'user') is int 123; give a string"),
    (None, "messages[0].content (role 'user') is null; give a string"),
    ([{"type": "image_url", "image_url": {"url": "x.png"}}], "messages[0].content[0] has type 'image_url'; give"),
    ([{"type": "text", "text": 5}], "messages[0].content[0] has no string 'text'; give"),
    (["yo"], "messages[0].content[0] has a str, not an object; give"),
])
def test_content_that_is_not_text_is_refused_naming_the_record(formatter, content, problem):
    """An object, a number, null (without tool calls) or a part that is not text is one error naming the file,
    line and message, where it was trained as its Python text ({'a': 1}, 123, None)."""
    from jaxft.data.errors import MissingFieldError
    from jaxft.data.sources import Record

    with pytest.raises(MissingFieldError) as info:
        formatter(Record({"messages": _chat(content)}, "chats.jsonl:7"))
    assert str(info.value).startswith(f"chats.jsonl:7: {problem}")


def test_an_assistant_tool_call_without_content_is_kept():
    """content null beside tool_calls (OpenAI's form of a call) is not an error (the tiny model's template has no
    tool role, so the check itself is asked)."""
    from jaxft.data.formatting import _checked_messages

    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    chat = [{"role": "user", "content": [{"type": "text", "text": "add 1 and 2"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "3"}]
    assert _checked_messages(chat, "chats.jsonl:1") == [{"role": "user", "content": "add 1 and 2"}, *chat[1:]]


# ------------------------------------------------------------------------------------------ every bad record
def test_every_bad_record_is_reported_the_first_ten_named(tmp_path):
    """13 records of no usable form among good ones: one error counts them all, names the first ten (file:line
    and why), and counts the rest, as bad JSON lines are reported; one bad record is its own error as before."""
    from jaxft.data.errors import MissingFieldError
    from jaxft.data.pipeline import DataConfig, build_datasets

    good = {"messages": _chat("hello")}
    bad = [{"messages": _chat({"a": i})} if i % 2 else {"body": "no known field"} for i in range(13)]
    lines = [good] + [r for b in bad for r in (b, good)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(MissingFieldError) as info:
        build_datasets(DataConfig(path=str(data), max_seq_length=64, batch_size=1), str(TINY_LLAMA))
    text = str(info.value)
    assert text.startswith(f"13 records cannot be trained on: {data}:2: record has keys ['body'] but none of the "
                           f"supported fields") and text.endswith("; and 3 more") and "\n" not in text
    named = [n for n in range(1, len(lines) + 1) if f"{data}:{n}: " in text]
    assert named == [2 * k + 2 for k in range(10)]
    assert f"{data}:4: messages[0].content (role 'user') is dict {{\"a\": 1}}" in text
    data.write_text(json.dumps(good) + "\n" + json.dumps(bad[1]) + "\n")
    with pytest.raises(MissingFieldError, match=rf"^{data}:2: messages\[0\]\.content \(role 'user'\) is dict"):
        build_datasets(DataConfig(path=str(data), max_seq_length=64, batch_size=1), str(TINY_LLAMA))


# ------------------------------------------------------------------------------------------ prompt vs context
def test_a_prompt_past_the_context_is_refused_or_truncated(model_dir, caplog):
    """The tiny model's context is 512 positions: a 600-token prompt with 8 new tokens is one error naming the
    lengths (it used to run into positions never trained, or out of memory for a prompt far past it); with
    truncate_prompt it is cut to its last 504 tokens, one warning line, and generates what those tokens do."""
    import jaxft
    from jaxft.generation import GenerationError, generate_ids

    model = jaxft.from_pretrained(model_dir, dtype="float32")
    long = np.random.default_rng(0).integers(3, 64, 600).tolist()
    with pytest.raises(GenerationError) as info:
        generate_ids(model, [[5, 6, 7], long], max_new_tokens=8)
    assert str(info.value) == ("prompt 1 has 600 tokens; with max_new_tokens 8 that is 608 positions, over the "
                               "model's context of 512 (max_position_embeddings); shorten the prompt, lower "
                               "max_new_tokens, or keep its last 504 tokens (truncate_prompt=True; jaxft-generate "
                               "--truncate)")
    with pytest.raises(GenerationError, match="^max_new_tokens 512 leaves no room for a prompt in the model's "
                                              "context of 512 tokens"):
        generate_ids(model, [[5, 6, 7]], max_new_tokens=512)
    with caplog.at_level(logging.WARNING, logger="jaxft.generation"):
        cut = generate_ids(model, [long], max_new_tokens=8, stop_token_ids=[], truncate_prompt=True)
    assert [r.getMessage() for r in caplog.records] == [
        "prompt 0 has 600 tokens; with max_new_tokens 8 that is 608 positions, over the model's context of 512 "
        "(max_position_embeddings): truncated to its last 504 tokens"]
    assert cut == generate_ids(model, [long[-504:]], max_new_tokens=8, stop_token_ids=[])


def test_jaxft_generate_refuses_a_prompt_past_the_context_in_one_line(capsys):
    """jaxft-generate on examples/tiny-llama (2048 positions) with a prompt of about 2500 tokens: exit 2 and one
    line naming the lengths and --truncate, before any memory is spent on it."""
    from jaxft.generate_cli import main

    assert main([str(TINY_LLAMA), "--prompt", " ".join(["cat"] * 2500), "--max-new-tokens", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxft-generate: error: prompt 0 has ")
    assert "with max_new_tokens 16 that is " in err[0] and err[0].endswith(
        "over the model's context of 2048 (max_position_embeddings); shorten the prompt, lower max_new_tokens, "
        "or keep its last 2032 tokens (truncate_prompt=True; jaxft-generate --truncate)")

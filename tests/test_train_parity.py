"""30 training steps on packed data match Hugging Face transformers + PEFT (torch, fp32) step by step.

Same tiny Llama (saved by transformers, loaded by both), same LoRA A/B values (copied from ours into PEFT), same
AdamW (constant lr, no clipping, no weight decay). The torch side sees every packed document unpacked (one
right-padded sequence each, positions from 0), which is the packed loss by definition: sum of target-token
cross-entropies over the step's documents / number of target tokens.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from test_train_fixtures import make_jsonl, make_tiny_model

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

STEPS, LR, RANK, ALPHA = 30, 1e-2, 4, 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
OUR_PARENT = {"self_attn": "attn", "mlp": "mlp"}


def _unpack(batch):
    """The documents of a packed batch: (input_ids, targets, loss_mask) per segment of each row."""
    docs = []
    for r in range(batch["input_ids"].shape[0]):
        seg = batch["segment_ids"][r]
        for j in np.unique(seg[seg > 0]):
            sel = seg == j
            docs.append((batch["input_ids"][r][sel], batch["targets"][r][sel], batch["loss_mask"][r][sel]))
    return docs


def _torch_loss(model, docs):
    n = max(len(d[0]) for d in docs)
    ids = torch.zeros((len(docs), n), dtype=torch.long)
    tgt = torch.zeros((len(docs), n), dtype=torch.long)
    mask = torch.zeros((len(docs), n), dtype=torch.float32)
    attn = torch.zeros((len(docs), n), dtype=torch.long)
    for i, (x, t, m) in enumerate(docs):
        ids[i, :len(x)], tgt[i, :len(x)] = torch.from_numpy(x.astype(np.int64)), torch.from_numpy(t.astype(np.int64))
        mask[i, :len(x)], attn[i, :len(x)] = torch.from_numpy(m), 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    return (ce * mask.reshape(-1)).sum() / mask.sum()


def test_loss_curve_matches_hf_peft(tmp_path):
    from transformers import LlamaForCausalLM

    from jaxft.data.pipeline import DataConfig, build_datasets
    from jaxft.io import from_pretrained
    from jaxft.lora import LoraConfig, apply_lora
    from jaxft.train import make_optimizer, make_schedule, make_train_step, split_model, stack_micro_batches

    model_dir = make_tiny_model(tmp_path / "model")
    data = make_jsonl(tmp_path / "train.jsonl", 120, seed=0)
    train_ds, _ = build_datasets(DataConfig(path=str(data), max_seq_length=128, batch_size=4, seed=0), str(model_dir))
    assert train_ds.num_batches_per_epoch >= 2  # the 30 steps run over several epochs of reshuffled rows

    # ---- ours: fp32, LoRA on every linear of every layer
    ours = from_pretrained(model_dir, "float32")
    apply_lora(ours, LoraConfig(r=RANK, alpha=ALPHA, target_modules=TARGETS), seed=0)
    graphdef, lora, frozen = split_model(ours)
    init_lora = jax.tree.map(np.array, lora)

    # ---- torch: the same base weights, PEFT LoRA with our initial A/B
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                 target_modules=list(TARGETS)))
    with torch.no_grad():
        for layer in range(hf.config.num_hidden_layers):
            for name in TARGETS:
                parent = HF_PARENT[name]
                mod = getattr(getattr(pm.base_model.model.model.layers[layer], parent), name)
                ours_lin = init_lora["layers"][OUR_PARENT[parent]][name]
                mod.lora_A["default"].weight.copy_(torch.from_numpy(ours_lin["lora_a"][layer].T.copy()))
                mod.lora_B["default"].weight.copy_(torch.from_numpy(ours_lin["lora_b"][layer].T.copy()))
    trainable = [p for p in pm.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == sum(x.size for x in jax.tree.leaves(init_lora))
    torch_opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    schedule = make_schedule("constant", LR, STEPS, 0)
    opt = make_optimizer(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=0.0)
    step_fn = make_train_step(graphdef, opt, schedule)
    opt_state = opt.init(lora)

    ours_losses, torch_losses = [], []
    for step in range(STEPS):
        batch = train_ds.batch(step)
        lora, opt_state, metrics = step_fn(lora, opt_state, frozen, stack_micro_batches(batch, 1),
                                           jax.random.key(step))
        ours_losses.append(float(metrics["loss"]))

        torch_opt.zero_grad()
        loss = _torch_loss(pm, _unpack(batch))
        loss.backward()
        torch_opt.step()
        torch_losses.append(float(loss.detach()))

    ours_losses, torch_losses = np.array(ours_losses), np.array(torch_losses)
    assert torch_losses[-5:].mean() < 0.8 * torch_losses[0]  # the curve moves: the comparison is meaningful
    np.testing.assert_allclose(ours_losses, torch_losses, rtol=1e-2)
    # In fp32 the agreement is much tighter than the 1% asked for (observed ~1e-6).
    np.testing.assert_allclose(ours_losses, torch_losses, rtol=1e-4)

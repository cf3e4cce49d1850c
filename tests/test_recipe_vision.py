"""`slimtune finetune` on a vision-language model: the tiny SmolVLM (tiny.make_tiny_vision_checkpoint) trained
as QLoRA on image + text rows (and a text row) through the one loop: the vision tower runs in every
micro-batch that holds an image; the merged save carries the vision weights as the base has them and loads
in plain transformers (``AutoModelForImageTextToText`` + ``AutoProcessor``) with the in-memory model's greedy
tokens on an image prompt; a run stopped mid-epoch resumes bit-exactly; `slimtune generate --image` and
`chat` answer from the checkpoint (merged and on the NF4 base) as the in-memory model does; 2 ranks (FSDP2)
follow the one-rank curve."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import PIL.Image
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.models.idefics3 import modeling_idefics3

from slimtune.cli import main
from slimtune.config import load_config
from slimtune.data import epoch_order, epoch_steps
from slimtune.formats.merge_source import MergeSource
from slimtune.generate import SamplingOptions, chat_loop, generate, image_prompt, load_for_generation
from slimtune.lora import lora_modules
from slimtune.recipes.finetune import run_finetune
from slimtune.tiny import make_tiny_vision_checkpoint
from tests.conftest import run_cli
from tests.test_dist_train import LOSS_RTOL
from tests.test_recipe import assert_same_adapters, metrics
from tests.test_vision_data import image_row, write_rows
from tests.test_vision_families import manifest_digests

TEXT_ROW = {"messages": [{"role": "user", "content": "No image here."}, {"role": "assistant", "content": "Fine."}]}
ROWS = [image_row("Color?", "Red.", ["red.png"]), image_row("Color?", "Blue.", ["blue.png"])] * 2 + [TEXT_ROW]
VISION_PREFIXES = ("model.vision_model.", "model.connector.")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-recipe")
    base = make_tiny_vision_checkpoint(root / "base")
    PIL.Image.new("RGB", (48, 40), (220, 30, 30)).save(root / "red.png")
    PIL.Image.new("RGB", (30, 60), (30, 30, 220)).save(root / "blue.png")
    data = write_rows(root / "train.jsonl", ROWS)
    settings = [
        f"model.path={base}",
        "model.create_tiny=false",
        f"dataset.path={data}",
        "dataset.create_builtin=false",
        "training.batch_size=2",
        "training.total_epochs=2",  # 5 rows, batch 2: 3 steps an epoch, the last of one row
        "lora.dropout=0.1",  # the RNG restore matters
        "logging.progress_bar=false",
    ]
    return dict(root=root, base=base, settings=settings)


@pytest.fixture(scope="module")
def straight(inputs):
    """All 6 steps in one run, the vision tower's forward passes counted."""
    calls = []
    forward = modeling_idefics3.Idefics3VisionTransformer.forward

    def counted(self, pixel_values, *args, **kwargs):
        calls.append(pixel_values.shape[0])
        return forward(self, pixel_values, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modeling_idefics3.Idefics3VisionTransformer, "forward", counted)
        result = run_finetune(load_config("tiny", [f"output_dir={inputs['root'] / 'straight'}", *inputs["settings"]]))
    return dict(result=result, calls=calls)


def prompt(loaded, image: Path):
    return image_prompt(loaded, [image], prompt="Color?")


def greedy(model, ids: list[int], pixels: dict, n: int = 6) -> list[int]:
    batch = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False, max_new_tokens=n, pad_token_id=256, **pixels)
    return out[0, len(ids) :].tolist()


def test_training_runs_the_vision_tower_in_every_micro_batch_with_an_image(straight):
    result, calls = straight["result"], straight["calls"]
    assert result.global_step == 6 and all(torch.isfinite(torch.tensor(result.losses)))
    plan = [mb for epoch in (0, 1) for step in epoch_steps(epoch_order(5, 0, epoch), 2, 1) for mb in step]
    with_images = [[i for i in mb if i < 4] for mb in plan]
    assert calls == [len(mb) for mb in with_images if mb]  # the images of each micro-batch, into the tower (row 4: text only)


def test_the_merged_save_keeps_the_vision_weights_and_loads_in_transformers_with_the_same_tokens(straight, inputs):
    result, ckpt, base = straight["result"], straight["result"].checkpoint, inputs["base"]
    merged, original = load_file(str(ckpt / "model-00001-of-00001.safetensors")), load_file(str(base / "model.safetensors"))
    assert merged.keys() == original.keys()
    vision = [k for k in merged if k.startswith(VISION_PREFIXES)]
    assert len(vision) > 20 and all(torch.equal(merged[k], original[k]) for k in vision)  # frozen, streamed as stored
    assert not torch.equal(
        merged["model.text_model.layers.0.self_attn.q_proj.weight"], original["model.text_model.layers.0.self_attn.q_proj.weight"]
    )
    processor = AutoProcessor.from_pretrained(ckpt)  # the checkpoint's processor files, unchanged
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    untrained = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.bfloat16).eval()
    adapter = load_for_generation(MergeSource(checkpoint=ckpt), form="adapter")
    for image in ("red.png", "blue.png"):
        ids, pixels = prompt(adapter, inputs["root"] / image)
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}], add_generation_prompt=True
        )
        plain = processor(text=[text], images=[[PIL.Image.open(inputs["root"] / image)]], add_special_tokens=False, return_tensors="pt")
        assert plain["input_ids"][0].tolist() == ids  # slimtune's image prompt is the processor's
        result.model.eval()
        in_memory = greedy(result.model, ids, pixels)
        assert greedy(adapter.model, ids, pixels) == in_memory  # the NF4 base + adapter: what training computed
        assert greedy(model, ids, {k: plain[k] for k in pixels}) == in_memory
        # the merged model's logits are the in-memory model's up to the merge's one rounding, far from the base's
        logits = [logits_of(m, plain) for m in (result.model, model, untrained)]
        assert (logits[1] - logits[0]).abs().max() < 0.1 * (logits[2] - logits[0]).abs().max(), image


def logits_of(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits.float()


def test_a_run_stopped_mid_epoch_resumes_bit_exactly(straight, inputs):
    out, settings = inputs["root"] / "resumed", inputs["settings"]
    first = run_finetune(load_config("tiny", [f"output_dir={out}", *settings, "training.stop_after_steps=1"]))
    assert first.global_step == 1
    second = run_finetune(load_config("tiny", [f"output_dir={out}", *settings, "resume=true"]))
    assert second.global_step == 6
    reference = metrics(inputs["root"] / "straight")
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in reference]  # bit-identical floats
    assert_same_adapters(out / "step-000006", inputs["root"] / "straight" / "step-000006")


def test_generate_and_chat_take_an_image(straight, inputs, capsys):
    ckpt, image = straight["result"].checkpoint, inputs["root"] / "red.png"
    loaded = load_for_generation(MergeSource(checkpoint=ckpt))  # merged
    options = SamplingOptions(max_new_tokens=6, temperature=0.0)
    expected = generate(loaded, *prompt(loaded, image)[:1], options, pixels=prompt(loaded, image)[1])
    code = main(["generate", str(ckpt), "--prompt", "Color?", "--image", str(image), "--temperature", "0", "--max-new-tokens", "6"])
    assert code == 0 and capsys.readouterr().out == expected + "\n"
    lines, shown = iter(["Color?", "/exit"]), []
    chat_loop(loaded, options, read=lambda _: next(lines), write=shown.append, images=[image])
    assert "".join(shown).splitlines()[1] == expected
    code = main(["generate", str(ckpt), "--prompt", "Color?", "--image", str(inputs["root"] / "nope.png")])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and error == f"slimtune generate: error: --image {inputs['root'] / 'nope.png'}: no such image file"


@pytest.mark.multiprocess
def test_two_ranks_on_image_rows_follow_the_one_rank_curve(inputs):
    """FSDP2 on 2 ranks (gloo, CPU), one epoch without dropout (each rank draws its own masks): each rank's
    half of a micro-batch carries its rows' images (a rank without a row runs a filler row with its images
    and no trained token); the curve is the one-rank run's up to reduction order (tests/test_dist_train.py's
    bound) and the vision weights are saved as stored."""
    root, settings = inputs["root"], [*inputs["settings"], "training.total_epochs=1", "lora.dropout=0.0"]
    run_finetune(load_config("tiny", [f"output_dir={root / 'one-rank'}", *settings]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_cli("finetune", "--nproc", "2", "--config", "tiny", f"output_dir={root / 'two-ranks'}", *settings, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "2 ranks (FSDP2)" in proc.stdout
    one, two = metrics(root / "one-rank"), metrics(root / "two-ranks")
    assert [m["step"] for m in two] == [1, 2, 3]
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=LOSS_RTOL)
    merged = load_file(str(root / "two-ranks" / "step-000003" / "model-00001-of-00001.safetensors"))
    original = load_file(str(inputs["base"] / "model.safetensors"))
    assert merged.keys() == original.keys()
    assert all(torch.equal(merged[k], original[k]) for k in merged if k.startswith(VISION_PREFIXES))


def test_the_offline_merge_of_the_runs_adapter_is_its_merged_save(straight, inputs, tmp_path, capsys):
    """`slimtune merge --merge-base quantized` of the run's adapter onto the base on disk writes the
    checkpoint's merged files byte for byte, the vision tensors and the processor files included."""
    ckpt, out = straight["result"].checkpoint, tmp_path / "merged"
    code = main(
        ["merge", "--base", str(inputs["base"]), "--adapter", str(ckpt / "adapter"), "--out", str(out), "--merge-base", "quantized"]
    )
    assert code == 0, capsys.readouterr().err
    saved, merged = manifest_digests(ckpt), manifest_digests(out)
    assert {"model-00001-of-00001.safetensors", "processor_config.json", "chat_template.jinja"} <= set(merged) <= set(saved)
    assert {p: saved[p] for p in merged} == merged


def test_a_base_whose_chat_template_is_the_processors_only_trains_and_its_checkpoint_keeps_it(inputs, tmp_path):
    """The legacy processor layout: the chat template in chat_template.json (the processor's), none for the
    tokenizer. Chat rows render with the processor's template, and the checkpoint carries the processor's
    files as the base has them: `AutoProcessor` loads it and `generate --image` runs on it."""
    base = tmp_path / "base"
    shutil.copytree(inputs["base"], base)
    template = (base / "chat_template.jinja").read_text()
    (base / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (base / "chat_template.jinja").unlink()
    settings = [f"model.path={base}", *inputs["settings"][1:], "training.max_steps=1", "checkpoint.async=false"]
    result = run_finetune(load_config("tiny", [f"output_dir={tmp_path / 'run'}", *settings]))
    ckpt = result.checkpoint
    assert (ckpt / "chat_template.json").read_bytes() == (base / "chat_template.json").read_bytes()
    assert (ckpt / "processor_config.json").read_bytes() == (base / "processor_config.json").read_bytes()
    assert AutoProcessor.from_pretrained(ckpt).chat_template == template
    loaded = load_for_generation(MergeSource(checkpoint=ckpt))
    ids, pixels = prompt(loaded, inputs["root"] / "red.png")
    assert ids.count(loaded.processor.image_token_id) == 4 and "pixel_values" in pixels


def test_lora_vision_adapters_on_the_tower_load_for_generation_on_the_nf4_base(inputs, tmp_path):
    """`lora.vision: true` with all-linear: the adapter holds the tower's linears too, and `generate --form
    adapter` puts every one of them back on the NF4 base (none silently left out): its logits on an image
    prompt are the merged checkpoint's up to the merge's one rounding."""
    settings = [*inputs["settings"], "lora.vision=true", "lora.target_modules=all-linear", "training.max_steps=1", "checkpoint.async=false"]
    ckpt = run_finetune(load_config("tiny", [f"output_dir={tmp_path / 'run'}", *settings])).checkpoint
    adapter, merged = (load_for_generation(MergeSource(checkpoint=ckpt), form=f) for f in ("adapter", "merged"))
    tower = [n for n in lora_modules(adapter.model) if n.startswith("model.vision_model.encoder.")]
    assert len(tower) == 6 * 2 and len(lora_modules(adapter.model)) == 7 * 2 + 6 * 2
    ids, pixels = prompt(adapter, inputs["root"] / "red.png")
    batch = {"input_ids": torch.tensor([ids]), **pixels}
    ours, theirs = logits_of(adapter.model, batch), logits_of(merged.model, batch)
    base = logits_of(AutoModelForImageTextToText.from_pretrained(inputs["base"], dtype=torch.bfloat16).eval(), batch)
    assert (ours - theirs).abs().max() < 0.1 * (ours - base).abs().max()


# --- Gemma 3 ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3(inputs):
    """The tiny Gemma 3 (make_tiny_vision_checkpoint, Gemma3Processor) trained one epoch on the same rows; the
    token_type_ids each forward pass of training got beside its input_ids."""
    from transformers.models.gemma3 import modeling_gemma3

    root = inputs["root"]
    base = make_tiny_vision_checkpoint(root / "gemma3-base", model_type="gemma3")
    settings = [f"model.path={base}", *inputs["settings"][1:], "training.total_epochs=1", "checkpoint.async=false"]
    seen = []
    forward = modeling_gemma3.Gemma3ForConditionalGeneration.forward

    def recorded(self, input_ids=None, *args, token_type_ids=None, **kwargs):
        seen.append((input_ids, token_type_ids))
        return forward(self, input_ids, *args, token_type_ids=token_type_ids, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modeling_gemma3.Gemma3ForConditionalGeneration, "forward", recorded)
        result = run_finetune(load_config("tiny", [f"output_dir={root / 'gemma3'}", *settings]))
    return dict(base=base, result=result, seen=seen, settings=settings)


def test_gemma3_trains_on_image_rows_with_its_bidirectional_image_mask(gemma3):
    """Every forward pass of training gets token_type_ids, 1 exactly on the image (soft) tokens, as
    Gemma3Processor makes them: transformers then builds the mask in which an image's tokens see each other."""
    result, seen = gemma3["result"], gemma3["seen"]
    assert result.global_step == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    soft = AutoProcessor.from_pretrained(gemma3["base"]).tokenizer.image_token_id
    assert len(seen) >= 3 and all(types is not None for _, types in seen)
    assert all(torch.equal(types, (ids == soft).long()) for ids, types in seen)
    assert sum(int(types.sum()) for _, types in seen[:3]) == 4 * 4  # the 4 image rows of the epoch, 4 soft tokens each


def test_gemma3_merged_save_loads_in_transformers_and_generate_takes_an_image(gemma3, inputs, capsys):
    """The merged checkpoint loads with AutoModelForImageTextToText + AutoProcessor (its processor files as the
    base has them); on an image prompt the processor's inputs (token_type_ids included) give the in-memory
    model's greedy tokens, slimtune's image prompt is the processor's, and `slimtune generate --image` answers."""
    result, base, ckpt = gemma3["result"], gemma3["base"], gemma3["result"].checkpoint
    for name in ("processor_config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (ckpt / name).read_bytes() == (base / name).read_bytes(), name
    processor = AutoProcessor.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    assert type(processor).__name__ == "Gemma3Processor" and type(model).__name__ == "Gemma3ForConditionalGeneration"
    merged = load_for_generation(MergeSource(checkpoint=ckpt))
    image = inputs["root"] / "red.png"
    ids, pixels = prompt(merged, image)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}], add_generation_prompt=True
    )
    plain = processor(text=[text], images=[[PIL.Image.open(image)]], add_special_tokens=False, return_tensors="pt")
    assert plain["input_ids"][0].tolist() == ids and set(pixels) == {"pixel_values", "token_type_ids"}
    assert torch.equal(pixels["token_type_ids"], plain["token_type_ids"])
    result.model.eval()
    in_memory = greedy(result.model, ids, pixels)
    assert greedy(model, ids, {k: plain[k] for k in pixels}) == in_memory
    untrained = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.bfloat16).eval()
    logits = [logits_of(m, plain) for m in (result.model, model, untrained)]
    assert (logits[1] - logits[0]).abs().max() < 0.1 * (logits[2] - logits[0]).abs().max()  # the merge's one rounding
    options = SamplingOptions(max_new_tokens=6, temperature=0.0)
    expected = generate(merged, ids, options, pixels=pixels)
    assert expected == merged.tokenizer.decode(in_memory, skip_special_tokens=True)
    code = main(["generate", str(ckpt), "--prompt", "Color?", "--image", str(image), "--temperature", "0", "--max-new-tokens", "6"])
    assert code == 0 and capsys.readouterr().out == expected + "\n"


def test_gemma3_offline_merge_of_the_runs_adapter_is_its_merged_save(gemma3, tmp_path, capsys):
    """`slimtune merge --merge-base quantized` of the Gemma 3 run's adapter onto its base writes the checkpoint's
    merged files byte for byte, the vision tensors and Gemma 3's processor files included."""
    ckpt, out = gemma3["result"].checkpoint, tmp_path / "merged"
    argv = ["merge", "--base", str(gemma3["base"]), "--adapter", str(ckpt / "adapter"), "--out", str(out), "--merge-base", "quantized"]
    assert main(argv) == 0, capsys.readouterr().err
    saved, merged = manifest_digests(ckpt), manifest_digests(out)
    assert {"model-00001-of-00001.safetensors", "processor_config.json", "tokenizer_config.json", "chat_template.jinja"} <= set(merged)
    assert set(merged) <= set(saved) and {p: saved[p] for p in merged} == merged


def test_gemma3_run_stopped_after_a_step_resumes_bit_exactly(gemma3, inputs):
    """Stopped after step 1 and resumed, the Gemma 3 run's losses and adapters are the straight run's, bit for bit."""
    out, settings = inputs["root"] / "gemma3-resumed", gemma3["settings"]
    assert run_finetune(load_config("tiny", [f"output_dir={out}", *settings, "training.stop_after_steps=1"])).global_step == 1
    assert run_finetune(load_config("tiny", [f"output_dir={out}", *settings, "resume=true"])).global_step == 3
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(inputs["root"] / "gemma3")]
    assert_same_adapters(out / "step-000003", inputs["root"] / "gemma3" / "step-000003")

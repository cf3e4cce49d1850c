"""The config keys: one frozen dataclass per section, each field a key (its type, default, description
and limits); ``Config`` is the whole, SCHEMA the keys it holds in order."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

from slimtune.config.schema import PLACEHOLDER, REQUIRED, ConfigPath, DataPath, Key, ModelPath, RunDir, Size, setting, walk
from slimtune.errors import SlimtuneError
from slimtune.formats.gguf_types import GgufType
from slimtune.lora import DEFAULT_TARGETS
from slimtune.memory import DEFAULT_SHARD_SIZE


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    """model.*: the base checkpoint the adapters train on."""

    path: ModelPath = setting(
        REQUIRED,
        "Hugging Face checkpoint of a supported family (README: Model families): a local directory, or a hub id org/name "
        "(org/name@revision pins a branch, tag or commit) fetched through huggingface_hub's cache (HF_HOME, HF_HUB_OFFLINE, "
        f"HF_TOKEN); a local directory of the same name wins. '{PLACEHOLDER}' is replaced by output_dir.",
        fixed=True,
    )
    create_tiny: bool = setting(
        False, "When model.path does not exist and is not a hub id, write the embedded tiny Llama there (offline demo)."
    )
    adapter: ConfigPath | None = setting(
        None,
        "Start from this LoRA adapter (a checkpoint step-N/, its adapter/ directory or an adapter_model.safetensors, of the "
        "same lora.rank and targets) instead of fresh adapters; with a preference objective it is also the frozen reference.",
        fixed=True,
    )


@dataclass(frozen=True, kw_only=True)
class LoraSection:
    """lora.*: the adapters."""

    rank: int = setting(8, "LoRA rank r.", minimum=1, fixed=True)
    alpha: float = setting(16.0, "LoRA alpha; the update is scaled by alpha / r (alpha / sqrt(r) with rsLoRA).", minimum=0, fixed=True)
    dropout: float = setting(0.0, "Dropout on the adapter input during training.", minimum=0, maximum=1)
    use_rslora: bool = setting(False, "Rank-stabilised scaling alpha / sqrt(r).", fixed=True)
    target_modules: list[str] = setting(
        list(DEFAULT_TARGETS),
        "Layers that get an adapter (NF4 base): all-linear (PEFT's convention: every linear layer except the output head, "
        "resolved per family and printed at start) or layer names such as [q_proj, v_proj].",
        fixed=True,
    )
    vision: bool = setting(
        False,
        "Vision-language models: LoRA (on NF4) on the vision tower's linears too; by default the tower and projector stay "
        "frozen in the base dtype. The projector is never adapted.",
        fixed=True,
    )


@dataclass(frozen=True, kw_only=True)
class DatasetSection:
    """dataset.*: the data files, their shapes and how examples are cut."""

    path: DataPath = setting(
        REQUIRED,
        "Local data file: JSONL (one object per line), a JSON array, Parquet, Arrow or CSV, with rows of one of the shapes of "
        f"dataset.format; '{PLACEHOLDER}' is replaced by output_dir. Or a hub dataset, org/name[@revision][:split] or "
        "org/name[@revision][:subset:split] (split train by default), through datasets.load_dataset and the hub cache; a "
        "local file of that name wins.",
        fixed=True,
    )
    mix: list[DataPath] | None = setting(
        None, "More data files (or hub datasets) trained on together with dataset.path (same types and shapes).", fixed=True
    )
    weights: list[float] | None = setting(
        None,
        "One weight per file (dataset.path, then dataset.mix): each epoch holds weight x the file's examples (whole repeats, "
        "then a seeded subset); null: 1 each.",
        fixed=True,
    )
    columns: dict[str, str] | None = setting(
        None,
        "Rename columns to the shape's keys, e.g. {instruction: question, output: answer} (or instruction=question,output=answer).",
        fixed=True,
    )
    format: Literal["auto", "alpaca", "chat", "sharegpt", "completion", "text"] = setting(
        "auto",
        "Row shape: alpaca, chat (messages), sharegpt (conversations from/value), completion (prompt/completion) or text; "
        "auto decides per row from its keys.",
        fixed=True,
    )
    max_seq_len: int = setting(512, "Sequences are truncated to this many tokens.", minimum=2, fixed=True)
    shuffle: bool = setting(True, "Shuffle the examples each epoch (seeded by seed and the epoch).", fixed=True)
    train_on_inputs: bool = setting(False, "Train on every token, prompts and user turns included (default: responses only).", fixed=True)
    packed: bool = setting(
        False,
        "Pack examples into rows of max_seq_len tokens; attention never crosses a document boundary (position ids restart).",
        fixed=True,
    )
    eval_path: DataPath | None = setting(
        None,
        f"Held-out data file for evaluation (any supported type, or a hub dataset as dataset.path: org/name:test); '{PLACEHOLDER}' "
        "is replaced by output_dir.",
    )
    eval_fraction: float = setting(
        0.0,
        "Without eval_path: hold out this fraction of each file (a seeded split) for evaluation; 0: no evaluation.",
        minimum=0,
        maximum=1,
        fixed=True,
    )
    create_builtin: bool = setting(False, "When dataset.path does not exist, write the small built-in dataset there.")


@dataclass(frozen=True, kw_only=True)
class TrainingSection:
    """training.*: batches, length of the run, evaluation and samples, compute."""

    batch_size: int = setting(
        2,
        "Sequences per micro-batch, all ranks together (each takes its slice): the same global batch on any number of ranks.",
        minimum=1,
        fixed=True,
    )
    gradient_accumulation_steps: int = setting(
        1, "Micro-batches per optimizer step; the loss is averaged over all their trained tokens.", minimum=1, fixed=True
    )
    total_epochs: int = setting(1, "Passes over the dataset.", minimum=1)
    max_steps: int | None = setting(
        None,
        "Last optimizer step of the run (caps total_epochs); with total_epochs it sets the length of the cosine schedule.",
        minimum=1,
    )
    stop_after_steps: int | None = setting(
        None,
        "End this invocation after this global step, with a checkpoint; the schedule is unchanged, so resume=true continues "
        "the run exactly (split a long run over sessions).",
        minimum=1,
    )
    max_grad_norm: float | None = setting(1.0, "Clip the adapters' gradient norm to this; null: no clipping.", minimum=0)
    eval_every_n_steps: int | None = setting(
        None, "Evaluate every n optimizer steps (and at every checkpoint) when there is eval data.", minimum=1
    )
    sample_prompts: list[str] | None = setting(None, "Prompts generated from (greedy) at each checkpoint, into metrics.jsonl and the log.")
    sample_max_new_tokens: int = setting(32, "Tokens generated per sample prompt.", minimum=1)
    activation_checkpointing: bool = setting(False, "Recompute layer activations in the backward pass: less memory, more compute.")
    compile: bool = setting(
        False,
        "torch.compile each decoder layer (regional compilation, as torchtune does): inductor on CPU and CUDA; the first "
        "steps pay a one-off compile (logged), later ones run faster.",
    )
    objective: Literal["sft", "dpo", "ipo", "simpo", "grpo"] = setting(
        "sft",
        "sft: next-token loss on dataset rows; dpo (sigmoid), ipo: preference pairs against the reference (the model as "
        "loaded); simpo: reference-free preference loss (TRL's CPO loss_type=simpo). docs/training.md: Preference tuning. "
        "grpo: online RL on prompt-only rows, completions sampled from the policy and scored by grpo.reward_funcs "
        "(docs/training.md: Reinforcement learning).",
        fixed=True,
    )
    num_threads: int | None = setting(
        None,
        "CPU threads torch uses; null: the cores this process may use (its CPU affinity), divided among the ranks on this "
        "machine under torchrun (never the momentary load: runs stay reproducible). Set it lower where other processes share the cores.",
        minimum=1,
    )


@dataclass(frozen=True, kw_only=True)
class PreferenceSection:
    """preference.*: the preference objectives (training.objective dpo, ipo, simpo), TRL 1.16's defaults."""

    beta: float = setting(
        0.1, "beta of TRL's DPOConfig / CPOConfig: the reward scale (dpo, simpo); IPO's regularisation tau (ipo).", minimum=0
    )
    label_smoothing: float = setting(
        0.0,
        "simpo only (TRL CPO): the conservative loss's label-noise rate; TRL 1.16's DPO sigmoid and IPO losses take none.",
        minimum=0,
        maximum=0.5,
    )
    simpo_gamma: float = setting(0.5, "simpo: the target reward margin gamma (TRL CPOConfig.simpo_gamma).", minimum=0)
    cpo_alpha: float = setting(
        1.0, "simpo: weight of the chosen answers' next-token loss added to the loss (TRL CPOConfig.cpo_alpha; 0: pure SimPO).", minimum=0
    )
    truncation_mode: Literal["keep_start", "keep_end"] = setting(
        "keep_start",
        "TRL's: prompt + answer longer than dataset.max_seq_len (TRL's max_length) keeps its start (keep_start) or its end (keep_end).",
        fixed=True,
    )
    bad_rows: Literal["error", "drop"] = setting(
        "error",
        "A bad pair (missing key, empty or identical answers, a prompt that fills dataset.max_seq_len): error (one line naming "
        "file and row, exit 2) or drop (skipped, counted in the log).",
        fixed=True,
    )


@dataclass(frozen=True, kw_only=True)
class GRPOSection:
    """grpo.*: the online objective (training.objective grpo), TRL 1.16's GRPOConfig names and defaults."""

    num_generations: int = setting(
        8, "Completions sampled per prompt (a group); training.batch_size counts prompts.", minimum=2, fixed=True
    )
    max_completion_length: int = setting(256, "Tokens sampled per completion at most (TRL's default is 512).", minimum=1)
    max_prompt_length: int | None = setting(None, "Cut longer prompts to their last tokens (null: never, as TRL 1.16).", minimum=1)
    temperature: float = setting(1.0, "Sampling temperature; the loss's log-probabilities use logits / temperature, as TRL's.", minimum=0)
    top_p: float = setting(
        1.0, "Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: all); in (0, 1].", minimum=0
    )
    top_k: int = setting(0, "Sample from the k most likely tokens only; 0: all.", minimum=0)
    generation_batch_tokens: int = setting(
        16384,
        "Padded positions (prompt + max_completion_length) per generation chunk: bounds the KV cache and logits of one chunk.",
        minimum=1,
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = setting(
        "dapo", "How the per-token loss is reduced (docs/training.md: the loss family); TRL 1.16's default is dapo."
    )
    importance_sampling_level: Literal["token", "sequence"] = setting(
        "token", "The ratio's level: per token, or one per completion from its mean log-ratio (GSPO)."
    )
    epsilon: float = setting(0.2, "Lower clip: the ratio is clipped to [1 - epsilon, 1 + epsilon_high].", minimum=0)
    epsilon_high: float | None = setting(None, "Upper clip (null: epsilon; DAPO recommends 0.28).", minimum=0)
    beta: float = setting(0.0, "KL coefficient against the reference (the model as loaded); 0: no reference pass at all.", minimum=0)
    use_bias_correction_kl: bool = setting(
        True, "Multiply the KL term by the importance ratio (TRL's default): the unbiased reverse-KL gradient."
    )
    scale_rewards: Literal["group", "batch", "none"] = setting(
        "group", "Divide the advantages by the group's reward std (group), the generation batch's (batch), or not (none)."
    )
    mask_truncated_completions: bool = setting(False, "Leave completions cut at max_completion_length out of the loss.")
    num_iterations: int = setting(
        1, "Optimizer steps per generation batch (TRL's mu), against the stored old log-probabilities.", minimum=1
    )
    reward_funcs: list[str] = setting(
        ["exact_answer"], "Reward functions: built-ins (exact_answer, format, length_penalty) and/or module:function references."
    )
    reward_weights: list[float] | None = setting(None, "One weight per reward function (null: 1 each).")
    answer_pattern: str = setting(
        r"(-?\d+(?:\.\d+)?)\s*$", "exact_answer: a regex whose first group is the completion's answer (the last number by default)."
    )
    answer_column: str = setting("answer", "exact_answer: the column holding each row's answer.")
    format_pattern: str = setting(r".*", "format: a regex the whole completion must match (re.fullmatch, DOTALL).")
    eval_samples: int = setting(4, "Sampled eval completions written to completions.jsonl at each evaluation.", minimum=0)
    bad_rows: Literal["error", "drop"] = setting(
        "error", "A bad prompt row: error (one line naming file and row, exit 2) or drop (skipped, counted in the log).", fixed=True
    )


@dataclass(frozen=True, kw_only=True)
class OptimizerSection:
    """optimizer.*: AdamW over the adapter parameters."""

    lr: float = setting(2e-4, "Peak learning rate of AdamW (adapter parameters only).", minimum=0)
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay.", minimum=0)


@dataclass(frozen=True, kw_only=True)
class SchedulerSection:
    """scheduler.*: linear warmup, then cosine decay."""

    warmup_steps: int = setting(0, "Linear warmup steps before the cosine decay.", minimum=0)
    min_lr_ratio: float = setting(0.0, "The cosine decays to lr * min_lr_ratio at the end of the run.", minimum=0)


@dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    """checkpoint.*: what is saved, when, how and in which formats."""

    save_every_n_steps: int | None = setting(
        None, "Also save every n optimizer steps (a checkpoint is always saved at each epoch end and when the run stops).", minimum=1
    )
    merged: Literal["every", "final", "never"] = setting(
        "every", "Which checkpoints hold the merged model beside the adapter: every, final (only the run's last) or never."
    )
    merged_dtype: Literal["fp32", "fp16", "bf16"] | None = setting(
        None,
        "dtype of the merged model's weights (null: the base checkpoint's). W' + B A is computed in fp32 and rounded once "
        "to this dtype; fp32 skips that rounding (eval_loss_merged in metrics.jsonl measures what it costs).",
    )
    keep_last_n: int | None = setting(
        None, "Keep only the newest n complete checkpoints (the newest is never deleted); null keeps all.", minimum=1
    )
    max_shard_size: Size = setting(DEFAULT_SHARD_SIZE, "Largest merged safetensors shard, e.g. 2GB or 500MiB.")
    async_: bool = setting(
        True,
        "Save in the background: training blocks only to snapshot the adapters and training state, a writer process writes the "
        "checkpoint (on the CPU forked at each save point, sharing the trainer's memory; with a GPU or under torchrun one writer per "
        "rank, started with the run, each writing that rank's part of the cooperative save); only when a save point comes before "
        "the run's last step.",
        name="async",
    )
    gguf: GgufType | None = setting(  # the names of `slimtune export --type` (slimtune.formats.gguf_types)
        None,
        "Also write model-TYPE.gguf (+ an Ollama Modelfile; a vision model's model-mmproj-f16.gguf) beside the run's final "
        "checkpoint, for llama.cpp/Ollama (docs/gguf.md).",
    )
    gguf_verify: bool = setting(
        True,
        "Check the final checkpoint's sha256 against its manifest while checkpoint.gguf reads it (false: read it unchecked).",
    )


@dataclass(frozen=True, kw_only=True)
class WandbSection:
    """logging.wandb.*: Weights & Biases."""

    project: str | None = setting(None, "Also log to this Weights & Biases project (extra: wandb).")
    mode: Literal["offline", "online"] = setting("offline", "W&B mode: offline (no network; sync later) or online.")


@dataclass(frozen=True, kw_only=True)
class LoggingSection:
    """logging.*: progress bar and trackers."""

    progress_bar: bool = setting(
        True, "Show a tqdm bar (loss, eval loss, lr, tokens/s; ckpt=saving while a background save runs) on stderr."
    )
    tensorboard: bool = setting(False, "Also write TensorBoard event files under output_dir/tensorboard (extra: tensorboard).")
    wandb: WandbSection


@dataclass(frozen=True, kw_only=True)
class Config:
    """A validated config: ``cfg.optimizer.lr`` reads like the YAML, typed; ``cfg.values`` is the flat
    dotted dict (``{"optimizer.lr": 2e-4, "checkpoint.async": True, ...}``) a checkpoint records."""

    output_dir: RunDir = setting(REQUIRED, "Run directory: checkpoints step-NNNNNN/, metrics.jsonl and loss.png.")
    seed: int = setting(0, "Seeds the LoRA initialisation, the data order and dropout.", minimum=0, fixed=True)
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "Where to train; auto picks cuda when available, else cpu.")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = setting(
        "auto",
        "Compute dtype of the frozen base (NF4 weights are dequantized to it; adapters stay fp32). auto: bf16 on GPUs with native "
        "bf16, fp16 (with loss scaling) on older GPUs; on the CPU bf16 where it multiplies bf16 natively (AVX512_BF16, AMX, "
        "Arm BF16), else fp32.",
    )
    resume: bool = setting(False, "Continue from the newest complete checkpoint in output_dir (starts fresh when there is none).")
    overwrite: bool = setting(False, "Start over when output_dir already holds checkpoints (they are deleted); otherwise that is an error.")
    model: ModelSection
    lora: LoraSection
    dataset: DatasetSection
    training: TrainingSection
    preference: PreferenceSection
    grpo: GRPOSection
    optimizer: OptimizerSection
    scheduler: SchedulerSection
    checkpoint: CheckpointSection
    logging: LoggingSection

    @property
    def values(self) -> dict[str, Any]:
        """Every key's value by dotted name, in schema order."""
        return {key.name: functools.reduce(getattr, key.attrs, self) for key in SCHEMA}

    def check(self) -> None:
        """The rules between keys, once every key is valid on its own (``validate`` runs it last): one line
        naming the key and what it must be.

        Example: ``cfg.check()``"""
        objective, preference = self.training.objective, self.preference
        if objective == "grpo":
            self._check_grpo()
            return
        if objective != "sft" and self.dataset.packed:
            raise SlimtuneError("dataset.packed: preference pairs are not packed (each pair's sequences are scored whole); set it false")
        if objective != "sft" and preference.label_smoothing and objective != "simpo":
            raise SlimtuneError(
                f"preference.label_smoothing is for simpo (TRL's CPO loss); TRL 1.16's {objective} loss takes none: set it 0"
            )
        if objective == "ipo" and preference.beta == 0:
            raise SlimtuneError("preference.beta must be above 0 for ipo (the loss holds 1 / (2 beta))")

    def _check_grpo(self) -> None:
        g = self.grpo
        if not 0 < g.top_p <= 1:
            raise SlimtuneError(f"grpo.top_p must be in (0, 1], got {g.top_p!r}")
        if self.dataset.packed:
            raise SlimtuneError("dataset.packed: grpo samples completions for each prompt; prompts are not packed: set it false")
        if g.reward_weights is not None and len(g.reward_weights) != len(g.reward_funcs):
            raise SlimtuneError(
                f"grpo.reward_weights has {len(g.reward_weights)} value(s); grpo.reward_funcs names {len(g.reward_funcs)} function(s)"
            )
        if not g.reward_funcs:
            raise SlimtuneError("grpo.reward_funcs is empty: name at least one reward function (a built-in or module:function)")


SCHEMA: tuple[Key, ...] = tuple(walk(Config))
KEYS: dict[str, Key] = {k.name: k for k in SCHEMA}

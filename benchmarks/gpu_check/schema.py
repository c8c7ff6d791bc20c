"""The GPU check's JSON schema, defined once: ``validate`` checks a result against it (the dry-run
test does) and ``render_markdown`` writes its tables (``--print-schema``), so the
documentation and the file cannot drift apart.

Every key the check writes is listed: an object's unlisted key is an error, except in objects
of kind ``object`` (free-form: their content is described in words, e.g. a hardware profile).
Units: bytes, seconds, GB/s = 1e9 bytes/s, TFLOPS = 1e12 FLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .report import SCHEMA_ID


@dataclass(frozen=True)
class Key:
    name: str
    kind: str
    """``str``, ``int``, ``number``, ``bool``, ``list``, ``object`` (free-form), ``record``
    (the keys of ``of``) or ``map`` (any keys, each value an ``of`` record)."""
    doc: str
    null: bool = False
    optional: bool = False
    """May be absent (a stage's data, present once the stage has started)."""
    of: Record | None = None


@dataclass(frozen=True)
class Record:
    title: str
    """Its path in the JSON, e.g. ``plans.<name>``."""
    keys: tuple[Key, ...]


K = Key


def R(title: str, *keys: Key) -> Record:
    return Record(title, keys)


STAGE = R("stages.<name>",
          K("status", "str", "`running` (killed while in it), `ok`, `failed` or `skipped`"),
          K("reason", "str", "why it was skipped: not selected, a stage it needs not ok, the time budget, "
                             "nothing to do", null=True),
          K("started_s", "number", "seconds from the check's start", null=True),
          K("wall_s", "number", "seconds it ran", null=True),
          K("error", "str", "`Type: message` of the exception (a `CheckFailed` when a result is out of "
                            "tolerance)", null=True),
          K("traceback", "str", "last 6000 characters", null=True))

HOST_RAM = R("host_ram",
             K("figure_used", "str", "`--host-budget-gb`: the RAM figure of every check"),
             K("host_budget_bytes", "int", "`--host-budget-gb` x 1e9"),
             K("memtotal_bytes", "int", "`MemTotal` at the start, reported only", null=True),
             K("memavailable_bytes", "int", "`MemAvailable` at the start, reported only", null=True),
             K("note", "str", "what uses which figure"))

DEVICE = R("device",
           K("python", "str", "version"), K("platform", "str", "`platform.platform()`"),
           K("cpu_count", "int", "`os.cpu_count()`"), K("torch", "str", "version"),
           K("torch_cuda", "str", "CUDA version torch was built with", null=True),
           K("torch_threads", "int", "`torch.get_num_threads()`"),
           K("packages", "object", "version of transformers, numba, highspy, blake3, deepspeed, pytest, "
                                   "pytest-timeout from their metadata (not imported), or `missing`"),
           K("device", "str", "`cuda`, or `cpu-async` in a dry run"),
           K("layerwise_commit", "str", "`git rev-parse HEAD`", null=True),
           K("kernels", "object", "which host kernels run, `numba` or `torch` (the fallback): "
                                  "`optimizer_8bit`, `grad_accumulation`, `split_master`; "
                                  "`numba`'s version; `host_avx512`: the host CPU has the 512-bit "
                                  "vectors the kernels are compiled for (null without numba)"),
           K("cuda_alloc_conf", "str", "`PYTORCH_CUDA_ALLOC_CONF` (the check adds `expandable_segments:True` "
                                       "unless given)", null=True),
           K("expandable_segments", "bool", "`cuda_alloc_conf` holds `expandable_segments:True`"),
           K("cuda_alloc_conf_source", "str", "`set by the check`, `given`, or `given; expandable_segments "
                                              "added by the check`"),
           K("cuda_alloc_conf_before_cuda_init", "bool", "it was set before CUDA started (the allocator "
                                                         "reads it then)", null=True),
           K("imported_from", "object", "the file highspy, blake3 and numba import from (null: they "
                                        "do not): whether `make gpu-wheels`' install took"),
           K("device_name", "str", "GPU 0", null=True), K("device_capability", "str", "e.g. `9.0`", null=True),
           K("device_total_mem_bytes", "int", "GPU 0's memory", null=True),
           K("device_multiprocessors", "int", "SMs", null=True),
           K("device_count", "int", "visible GPUs (0 in a dry run)"),
           K("nvidia_smi", "str", "name, driver, memory, SM clock", null=True),
           K("cuda_init_s", "number", "creating the CUDA context (first allocation)", null=True))

WHEEL = R("wheels.wheels.<name>",
          K("file", "str", "the `.whl` found for it", null=True),
          K("status", "str", "`installed`, `missing` (no `.whl` for an expected name) or `failed` "
                             "(pip's error below)"),
          K("error", "str", "pip's last 1000 characters", null=True),
          K("expected", "bool", "named by `--wheels` (else: another `.whl` of the folder)"))

WHEELS = R("wheels",
           K("wheel_dir", "str", "`--wheel-dir` (null: a dry run without it, nothing looked for)", null=True),
           K("site", "str", "`--wheel-site`: pip's `--target`, put on `sys.path` and `PYTHONPATH`", null=True),
           K("expected", "list", "`--wheels`' names (`make gpu-check`: the Makefile's `GPU_WHEELS`)"),
           K("wheels", "map", "each expected name and every other `.whl` there", of=WHEEL),
           K("counts", "object", "wheels per status"))

LAYER_CHECK = R("layer_check",
                K("flavor", "str", "`llama-debug`, widened on a GPU"), K("hidden_size", "int", ""),
                K("intermediate_size", "int", ""), K("num_heads", "int", ""), K("num_kv_heads", "int", ""),
                K("params", "int", "the layer's parameters"), K("batch", "int", ""), K("seq_len", "int", ""),
                K("dtype", "str", "`float32` (TF32 off)"),
                K("tolerance", "number", "largest relative error allowed, ‖a − b‖ / ‖b‖"),
                K("reference", "str", "HF's decoder layer under plain autograd on the CPU"),
                K("device_s", "number", "the device side: weights in, forward, `layer_backward`"),
                K("output_rel_err", "number", "layer output vs the reference"),
                K("grad_input_rel_err", "number", "gradient w.r.t. the input"),
                K("max_grad_param_rel_err", "number", "worst parameter gradient"),
                K("worst_param", "str", "its name"))

TINY_STEPS = R("tiny_steps",
               K("flavor", "str", "`llama-debug`"), K("num_layers", "int", "6"),
               K("boundary_tiers", "list", "host, nvme, recompute, device, device, host"),
               K("internal_tiers", "list", "recompute x 4, then device and host (kept internals)"),
               K("prefetch_depth", "int", "2"),
               K("op_counts", "object", "ops of the step program by kind (`fetch`, `recompute_layer`, "
                                        "`layer_fwd_keep`, `fetch_internals`, ...): what was exercised"),
               K("batch", "int", ""), K("seq_len", "int", ""), K("dtype", "str", "`float32` (TF32 off)"),
               K("tolerance", "number", "as `layer_check`"),
               K("ref_loss", "number", "HF autograd on the CPU"), K("loss", "number", "the engine's first step"),
               K("loss_rel_err", "number", ""), K("max_grad_rel_err", "number", "worst parameter gradient"),
               K("worst_param", "str", "its HF name"),
               K("train_losses", "list", "two `train_step`s (lr 1e-2) after the checked one; the second lower"),
               K("skipped_steps", "int", "non-finite gradient norms (must be 0)"),
               K("step_s", "list", "`StepStats.step_s` of the two"))

NVME_TIER = R("nvme_state.tiers.<kind>",
              K("units", "int", "units whose files it holds"),
              K("slots", "int", "units staged in RAM at once (`NVME_STATE_SLOTS`, `NVME_SOURCE_SLOTS`, "
                                "`NVME_GRAD_SLOTS`)"),
              K("file_bytes", "int", "its files' lengths"),
              K("staging_bytes", "int", "RAM its staging slots hold after the steps"),
              K("o_direct", "bool", "every file open with `O_DIRECT` (else buffered, each transfer synced "
                                    "and dropped from the page cache: the filesystem refused it)"),
              K("read_bytes_per_step", "list", "bytes read during each step, counted as reads complete"),
              K("written_bytes_per_step", "list", "bytes written during each step (a write behind may "
                                                  "complete in the next)"),
              K("read_bytes_total", "int", "since the tier was made (the weights' fill included), after "
                                           "the steps' writes drained and before the comparison reads"),
              K("written_bytes_total", "int", "same"))

NVME_STATE = R("nvme_state",
               K("flavor", "str", "`llama-debug`, widened as `layer_check` on a GPU"),
               K("num_layers", "int", "6"), K("hidden_size", "int", ""), K("intermediate_size", "int", ""),
               K("batch", "int", ""), K("seq_len", "int", "within one key block of flash attention (its "
                                                          "backward then sums in a fixed order)"),
               K("steps", "int", "per run (3), the same batches in both"),
               K("compute_dtype", "str", "`bfloat16` (`float32` in a dry run: bf16 matmuls on a CPU are slow)"),
               K("moments", "str", "`fp32`, every unit (the kernels `tiny_steps` compiled; the 8-bit ones "
                                   "compile in `optimizer`)"),
               K("state_tiers", "list", "per unit of the NVMe run: embed and head `nvme` (optimizer state), "
                                        "every layer `nvme-all` (state, copy source, gradient)"),
               K("directory", "str", "the `--out` JSON's folder: the tiers' files go in a temporary "
                                     "folder in it, removed after"),
               K("filesystem_type", "str", "its filesystem (`direct_io.filesystem_type`; \"\" unknown)"),
               K("in_ram", "bool", "that filesystem lives in RAM (tmpfs, ramfs): the stage fails, there is "
                                   "no disk to check"),
               K("weights_equal", "bool", "every unit's fp32 master equal to the bit after the steps, NVMe vs "
                                          "RAM (else the stage fails)"),
               K("moments_equal", "bool", "every unit's optimizer state equal to the bit (else the stage fails)"),
               K("unequal", "list", "`unit:tensor` of each that differs"),
               K("ram_losses", "list", "per step, all in RAM"), K("nvme_losses", "list", "per step, on NVMe"),
               K("ram_step_s", "list", "each step, `perf_counter` around `train_step` and `synchronize()`"),
               K("nvme_step_s", "list", "same, on NVMe"),
               K("ram_step_median_s", "number", "median of the steps after the first"),
               K("nvme_step_median_s", "number", "same, on NVMe"),
               K("step_time_over_ram", "number", "`nvme_step_median_s` / `ram_step_median_s`"),
               K("tiers", "map", "`state`, `source`, `grad`", of=NVME_TIER),
               K("page_cache_bytes_per_step", "list", "the tiers' files in the page cache after each step "
                                                      "(`mincore`)"),
               K("page_cache_max_bytes", "int", "their largest: 0 with `O_DIRECT`"),
               K("files_removed_at_close", "bool", "`store.close()` removed the files and their folder"))

PINNED_ARENA = R("pinned_arena",
                 K("store_pinned", "bool", "the store pins (CUDA available)"),
                 K("arena_bytes", "int", "the copy-source arena of a `llama-debug` store (bf16)"),
                 K("pinned_bytes", "int", "`store.pinned_nbytes()`"),
                 K("expected_pinned_bytes", "int", "the arena in whole pages (0 unpinned)"),
                 K("page_size_bytes", "int", ""), K("arena_is_pinned", "bool", "`arena.is_pinned()`", null=True),
                 K("probe_bytes", "int", "a larger region page-locked by `alloc_pinned` (768 MiB: not a power of "
                                         "two, so the fallback's rounding shows)"),
                 K("probe_registered", "bool", "locked in place (cudaHostRegister), not by the "
                                               "power-of-two fallback", null=True),
                 K("probe_locked_bytes", "int", "bytes locked", null=True),
                 K("probe_lock_s", "number", "time to lock it", null=True),
                 K("fallback_warning", "str", "the fallback's warning, if it happened", null=True))

COPY_BANDWIDTH = R("copy_bandwidth",
                   K("bytes", "int", "per copy"), K("repeats", "int", "best of, after a warm-up"),
                   K("timer", "str", "how copies are timed"),
                   *(K(f"{d}_{m}_gbps", "number", f"{d.upper()} from {what}")
                     for m, what in (("registered", "memory locked in place, as the store's arena"),
                                     ("pinned_alloc", "torch's pinned allocator"),
                                     ("pageable", "pageable memory"))
                     for d in ("h2d", "d2h")))

COLLECTION_ERROR = R("cuda_tests.collection_errors[]",
                     K("module", "str", "the test module pytest could not import"),
                     K("error", "str", "the last line of its error"))

CUDA_TESTS = R("cuda_tests",
               K("files", "list", "test files under tests/ whose text has `pytest.mark.cuda`"),
               K("ran_files", "list", "what pytest was given (a dry run: one generated file)"),
               K("command", "str", "the pytest command (plugins not auto-loaded; pytest-timeout by name)"),
               K("timeout_s", "number", "for the whole run"),
               K("host_mem_available_bytes", "int", "the RAM the tests' stores are checked against "
                                                    "(`LAYERWISE_HOST_MEM_AVAILABLE_BYTES`): the host "
                                                    "budget less the check's RSS, not `MemAvailable`",
                 null=True),
               K("exit_code", "int", "pytest's, null on timeout", null=True), K("timed_out", "bool", ""),
               K("wall_s", "number", ""),
               *(K(n, "int", d, null=True) for n, d in (
                   ("total", "tests collected and selected (JUnit), null without a JUnit file"),
                   ("passed", ""), ("failed", ""), ("errors", "errors of tests (not of collection)"),
                   ("skipped", ""))),
               K("failing_tests", "list", "`class::name` of failed and erroring tests"),
               K("collection_errors", "list", f"one `{COLLECTION_ERROR.title}` per module not collected "
                                              "(the stage fails; the other files still run)"),
               K("output_tail", "str", "last 4000 characters of pytest's output"))

MODEL = R("model",
          K("flavor", "str", "whose widths (`llama3-8b`; `llama-debug` in a dry run)"),
          K("source", "str", "where the shape comes from"), K("family", "str", ""),
          K("num_layers", "int", "run (lowered from the requested number until the host budget holds it)"),
          K("num_layers_requested", "int", "`--layers`"), K("num_layers_full", "int", "the flavor's"),
          *(K(n, "int", "") for n in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                                      "head_dim", "vocab_size")),
          K("tied", "bool", "tied embeddings"), K("num_params", "int", ""),
          K("seq_len", "int", ""), K("micro_batch_size", "int", ""), K("num_micro_batches", "int", ""),
          K("tokens_per_step", "int", ""),
          K("model_flops_per_step", "number", "cost model: 1x forward + 2x backward, no recompute"),
          K("compute_dtype", "str", "`bfloat16`"), K("moments", "str", "`8bit` or `fp32`, every unit"),
          K("store_bytes_estimate", "int", "`store_footprint` with the optimizer state: the store's total"),
          K("store_pinned_bytes_estimate", "int", "its page-locked arena"),
          K("host_activation_bytes_estimate", "int", "keep-all-host's pinned boundaries"),
          K("host_budget_bytes", "int", "what the sizing fits into (`HOST_FRACTION` of it, with a margin)"),
          K("device_mem_bytes", "int", "the GPU's memory"),
          K("device_mem_figure", "str", "`cuda total_memory`, or `h200 preset (dry run)`"),
          K("device_margin_bytes", "int", "`DEVICE_MARGIN_BYTES`: kept free of every plan's predicted peak"),
          K("device_budget_bytes", "int", "memory less margin: what the sizing fits and each engine's cap"),
          K("device_peak_predicted_bytes", "int", "the largest predicted CUDA peak (cuBLAS and attention "
                                                  "workspaces included) of the plans"),
          K("device_peak_plan", "str", "its plan"),
          K("fits_device", "bool", "that peak within `device_budget_bytes`"),
          K("data", "str", "what is trained on"))

CALIBRATION = R("calibration",
                K("calibrate_s", "number", "`planner.calibrate.calibrate`"), K("quick", "bool", "`--calibrate-quick`"),
                K("probes", "str", "`calibrate's own` sizes, or `dry-run sizes`"),
                K("profile", "object", "the calibrated `HardwareProfile` (as `layerwise calibrate --out`), "
                                       "`host_mem_bytes` set to the host budget"),
                K("layer_at_shape", "object", "`layer_bwd_s` (best of 3), `layer_bwd_flops` (3x the forward), "
                                              "`layer_bwd_tflops`: one layer's backward at the run's shape"),
                K("profile_at_shape", "object", "`peak_tflops`, `efficiency` of the `calibrated-shape` profile"),
                K("host_mem_bytes", "int", "the profile's host memory: the host budget"),
                K("host_mem_figure", "str", "`--host-budget-gb`"))

OPTIMIZER = R("optimizer",
              K("params", "int", ""), K("tensors", "int", ""), K("rounds", "int", "interleaved, medians"),
              K("shapes", "str", "`--optim-layers` decoder layers' tensors"),
              K("adamw8bit_step_s", "number", ""), K("torch_fused_step_s", "number", ""),
              K("step_ratio_vs_torch_fused", "number", "ours / torch (< 1: ours faster)"),
              K("adamw8bit_clip_step_s", "number", "with a global-norm clip of 1.0 (fused)"),
              K("torch_fused_clip_step_s", "number", "`clip_grad_norm_` + fused"),
              K("step_ratio_with_clip", "number", ""),
              K("adamw8bit_params_per_s", "number", ""), K("torch_fused_params_per_s", "number", ""),
              K("adamw8bit_state_bytes_per_param", "number", "moment bytes per parameter (~2.03)"),
              K("torch_fused_state_bytes_per_param", "number", "(8)"),
              K("update_rel_diff_after_3_steps", "number", "‖8-bit − fp32‖ / ‖fp32 − start‖ of the params"))

PLANNER = R("planner",
            K("hardware", "str", "profile used: `calibrated-shape`, else `calibrated`, else `h200`"),
            K("host_mem_bytes", "int", "that profile's host memory: the host budget"),
            K("host_mem_figure", "str", "`--host-budget-gb`"),
            K("milp_budget_s", "number", "HiGHS time of the search"),
            K("plan_s", "number", "whole search"), K("milp_solve_s", "number", "inside HiGHS"),
            K("source", "str", "`milp` or the rule emitted"), K("boundaries", "list", "tier per boundary"),
            K("tiers", "object", "count per tier"), K("micro_batch_size", "int", ""),
            K("num_micro_batches", "int", ""), K("prefetch_depth", "int", ""),
            K("moments_chosen", "object", "count per kind, as planned"),
            K("moments_used", "object", "count per kind, as run (the store's)"),
            K("predicted", "object", "the plan's own predictions (`step_s`, `tokens_per_s`, "
                                     "`peak_device_bytes`, ...)"),
            K("rules_simulated", "object", "simulated step seconds of every rule and the MILP"))

RAM_CHECK = R("store.ram_check",
              K("figure_used", "str", "`--host-budget-gb minus this process's RSS` (not `MemAvailable`)"),
              K("host_budget_bytes", "int", ""), K("process_rss_bytes", "int", "before the store"),
              K("available_bytes", "int", "given to `HostStore(mem_available=)`"),
              K("need_bytes", "int", "`store_footprint` with the optimizer state"),
              K("fits", "bool", "what the store's check decides"))

STORE = R("store",
          K("ram_check", "record", "the store's RAM check", of=RAM_CHECK),
          K("alloc_s", "number", "`HostStore(...)`: allocation and page-locking"),
          K("init_s", "number", "seeded fill + compute copy"),
          K("state_init_s", "number", "optimizer state of every unit"),
          K("init", "str", "how the weights were drawn"),
          K("footprint", "object", "`store.footprint()` by buffer (`master`, `grad`, `compute`, `state`, "
                                   "`copy_source`, `arena`, `pinned`, ...)"),
          K("store_nbytes", "int", "`store.nbytes()`"), K("pinned_nbytes", "int", "`store.pinned_nbytes()`"),
          K("copy_source_nbytes", "int", ""), K("pinned_over_copy_source", "number", "1.0 on a GPU (0 unpinned)"),
          K("estimate_matches_store", "bool", "`model.store_bytes_estimate` == `store_nbytes`"),
          K("host_allocator", "object", "`torch.cuda.host_memory_stats()` byte counters", null=True))

PLAN_ORDER = R("plan_order[]", K("plan", "str", "name"),
               K("predicted_peak_bytes", "int", "`predict_peak_device_bytes` on CUDA (bf16, with the "
                                                "cuBLAS and attention workspaces): the order"))

LORA_REC = R("plans.lora.lora",
             K("r", "int", "LoRA rank"), K("alpha", "number", ""),
             K("target_modules", "list", "`all-linear`: every linear of the decoder layers"),
             K("base_dtype", "str", "`nf4`: the frozen base quantised (QLoRA), dequantised on the device"),
             K("num_layers", "int", "decoder layers of the check's widths (`LORA_LAYERS`)"),
             K("lr", "number", "the adapters' learning rate"),
             K("adapter_params", "int", "trainable"), K("base_params", "int", "frozen"),
             K("base_host_bytes", "int", "`store.base_nbytes()`"),
             K("base_host_bytes_per_layer_param", "number", "decoder layers' base bytes per parameter "
                                                            "(~0.56 for NF4)"),
             K("build_s", "number", "adapter, store, seeded HF model copied in and quantised, adapters' init"),
             K("loss_finite", "bool", "every loss finite (else the stage fails)", optional=True),
             K("loss_decreased", "bool", "the last step's loss below the warm-up's (one batch throughout)",
               optional=True))

COPY_GROUP = ("`count`, `bytes`, `busy_s` (sum of durations), `union_s`, `gbps_active` (bytes / busy "
              "seconds), `overlap_s` (copies ∩ kernels), `overlap_fraction` (1: hidden behind compute), "
              "`streams`")

PLAN = R("plans.<name>",
         K("source", "str", "the plan's"), K("tiers", "object", "count per boundary tier"),
         K("boundaries", "list", ""), K("prefetch_depth", "int", ""), K("micro_batch_size", "int", ""),
         K("num_micro_batches", "int", ""), K("seq_len", "int", ""),
         K("micro_batches_per_load", "int", "micro-batches per weight load (the step's count: "
                                            "layer-major)"),
         K("examples_per_row", "int", "examples packed in a row (1: unpacked; `packed`: 3)"),
         K("store", "object", "the store it trained: `grad_dtype` (`bfloat16` where each gradient "
                              "lands once), `split_master`, `moments` (units per format)"),
         K("store_nbytes", "int", "`layer-major` only: its rebuilt store's `nbytes()`", optional=True),
         K("lora", "record", "`lora` only: the adapters and the frozen base", optional=True, of=LORA_REC),
         K("device_cap_bytes", "int", "`EngineConfig.device_mem_cap_bytes`: `model.device_budget_bytes` "
                                      "(a plan predicted over it is refused before it runs)"),
         K("engine_init_s", "number", "`StreamingEngine(...)`"),
         K("predicted_peak_bytes", "int", "`engine.predict_memory`"), K("predicted_peak_op", "str", ""),
         K("predicted_breakdown", "object", "bytes by category"),
         K("warmup_step_s", "number", "first step, drained"), K("steps", "int", "timed steps"),
         K("step_s", "number", "(end of the last update − start) / steps, back to back"),
         K("step_return_intervals_s", "list", "between `train_step` returns"),
         K("tokens_per_step", "int", ""), K("tokens_per_s", "number", ""),
         K("model_flops_per_step", "number", ""), K("tflops", "number", "cost-model FLOPs / `step_s`"),
         K("mfu", "number", "`tflops` / `mfu_peak_tflops`"),
         K("mfu_peak_tflops", "number", "calibrated at shape, else calibrated, else the preset"),
         K("losses", "list", "per step, warm-up first"), K("grad_norms", "list", ""), K("skipped_steps", "int", ""),
         K("device_peak_reserved_bytes", "int", "`max_memory_reserved` over the steps − reserved before "
                                                "the engine", null=True),
         K("device_peak_allocated_bytes", "int", "same with `max_memory_allocated`", null=True),
         K("reserved_over_predicted", "number", "", null=True),
         K("allocated_over_predicted", "number", "", null=True),
         K("profile", "object", "the profiled step: `profiled_step_s`, `trace_bytes`, `compute_stream`, "
                                "`kernel_streams`, `kernels`, `compute_busy_s`, `window_s`, "
                                "`compute_idle_fraction`, `pageable_copies`, and for `h2d`, `d2h`, "
                                f"`all_async_copies`, `copies_on_compute_stream`: {COPY_GROUP}", null=True),
         K("h2d_gbps", "number", "`profile.h2d.gbps_active`", null=True),
         K("d2h_gbps", "number", "`profile.d2h.gbps_active`", null=True),
         K("copy_overlap_fraction", "number", "`profile.all_async_copies.overlap_fraction`", null=True),
         K("host_allocator_after", "object", "pinned-allocator counters after the plan", null=True))

SIM_RUN = R("simulator.runs[]",
            K("plan", "str", "a measured plan"), K("profile", "str", "the hardware profile simulated"),
            K("step_s", "number", "simulated steady-state step"),
            K("measured_step_s", "number", "`plans.<plan>.step_s`"),
            K("error_pct", "number", "(simulated − measured) / measured x 100"),
            K("fits", "bool", ""), K("peak_device_bytes", "int", ""),
            K("busy_s", "object", "busy seconds per lane"))

SIMULATOR = R("simulator",
              K("profiles", "object", "every profile's fields (`h200`, `calibrated`, `calibrated-shape`)"),
              K("max_abs_error_pct", "object", "per profile, over the measured plans"),
              K("runs", "list", f"`{SIM_RUN.title}` records: each measured plan under each profile"))

TOP = R("(top level)",
        K("schema", "str", f"`{SCHEMA_ID}`"),
        K("status", "str", "`running`; then `ok` (every selected stage ok), `failed` (a first-contact "
                           "stage not ok, or none ok) or `partial`"),
        K("dry_run", "bool", "`--dry-run`"), K("started_at", "str", "UTC, ISO 8601"),
        K("wall_s", "number", "seconds since the start when last written"), K("budget_s", "number", ""),
        K("args", "object", "every option as parsed"),
        K("stages", "map", "per stage, in run order: `wheels`, `device`, `layer_check`, `tiny_steps`, "
                           "`nvme_state`, `pinned_arena`, `copy_bandwidth`, `cuda_tests`, `model`, `calibration`, "
                           "`optimizer`, `planner`, `plan:lora`, `store`, `plan:<name>`, `simulator`", of=STAGE),
        K("host_ram", "record", "the RAM figure the checks use, beside the kernel's", of=HOST_RAM),
        *(K(r.title, "record", f"stage `{r.title}`'s result", optional=True, of=r)
          for r in (WHEELS, DEVICE, LAYER_CHECK, TINY_STEPS, NVME_STATE, PINNED_ARENA, COPY_BANDWIDTH)),
        K("first_contact_s", "number", "seconds from the start to the end of `copy_bandwidth`", optional=True),
        K("cuda_tests", "record", "stage `cuda_tests`'s result", optional=True, of=CUDA_TESTS),
        *(K(r.title, "record", f"stage `{r.title}`'s result", optional=True, of=r)
          for r in (MODEL, CALIBRATION, OPTIMIZER, PLANNER, STORE)),
        K("plan_order", "list", f"`{PLAN_ORDER.title}` records: the plans in the order they run (the "
                                "planner's first, then the rules smallest predicted device peak first, "
                                "then `packed` and `layer-major`)", optional=True),
        K("plans", "map", "per plan run (`lora`: every-1 over one layer of the model's widths, NF4 "
                          "frozen base, LoRA r=16 on every linear; `planner`, `every-1`, `every-4`, "
                          "`keep-all-host`, `packed`: "
                          "every-4 over rows packed with 3 examples of uneven lengths and padding, and "
                          "`layer-major`: keep-all-host boundaries in layer-major order over 2 "
                          "micro-batches at least, bf16 host gradients, the split master, the run's "
                          "moments, on a store rebuilt for it)", optional=True, of=PLAN),
        K("simulator", "record", "stage `simulator`'s result", optional=True, of=SIMULATOR),
        K("failed_stages", "list", "names, at the end", optional=True),
        K("skipped_stages", "list", "names, at the end (not counting stages not selected)", optional=True))

LIST_ITEMS = {("cuda_tests", "collection_errors"): COLLECTION_ERROR, ("plan_order",): PLAN_ORDER,
              ("simulator", "runs"): SIM_RUN}
"""Lists whose items are records."""


def _kind_ok(kind: str, v: Any) -> bool:
    if isinstance(v, bool):
        return kind == "bool"
    types = {"str": str, "int": int, "number": (int, float), "bool": bool, "list": list}
    return isinstance(v, types.get(kind, dict))  # object, record, map: a dict


def validate(value: Any, record: Record = TOP, path: tuple[str, ...] = ()) -> list[str]:
    """Every way ``value`` departs from ``record``: missing keys, wrong kinds, unlisted keys."""
    where = ".".join(path) or "(top level)"
    if not isinstance(value, dict):
        return [f"{where}: expected an object"]
    errors = [f"{where}.{k}: not in the schema" for k in value if k not in {key.name for key in record.keys}]
    for key in record.keys:
        sub = path + (key.name,)
        if key.name not in value:
            if not key.optional:
                errors.append(f"{'.'.join(sub)}: missing")
            continue
        v = value[key.name]
        if v is None:
            if not key.null:
                errors.append(f"{'.'.join(sub)}: null")
            continue
        if not _kind_ok(key.kind, v):
            errors.append(f"{'.'.join(sub)}: {type(v).__name__}, expected {key.kind}")
        elif key.kind == "record":
            errors += validate(v, key.of, sub)
        elif key.kind == "map":
            for name, item in v.items():
                errors += validate(item, key.of, sub + (name,))
        elif key.kind == "list" and sub in LIST_ITEMS:
            for i, item in enumerate(v):
                errors += validate(item, LIST_ITEMS[sub], sub + (str(i),))
    return errors


def _records(record: Record, seen: list[Record]) -> list[Record]:
    if record not in seen:
        seen.append(record)
        for key in record.keys:
            if key.of is not None:
                _records(key.of, seen)
    return seen


def render_markdown() -> str:
    """One table per record (the top level first), as ``--print-schema`` prints them."""
    records = _records(TOP, [])
    lines = []
    for rec in records + [r for r in LIST_ITEMS.values() if r not in records]:
        lines += [f"`{rec.title}`", "", "| key | type | meaning |", "|---|---|---|"]
        for key in rec.keys:
            kind = {"record": f"`{key.of.title}`" if key.of else "object",
                    "map": f"map of `{key.of.title}`" if key.of else "map"}.get(key.kind, key.kind)
            kind += " or null" if key.null else ""
            kind += " (optional)" if key.optional else ""
            doc = key.doc.replace("|", "\\|")
            lines.append(f"| `{key.name}` | {kind} | {doc} |")
        lines.append("")
    return "\n".join(lines)

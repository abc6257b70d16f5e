"""The published Megatron-Bridge throughput table (``data/published_throughput.csv``) as recipes.

Each row becomes the recipe of its model family with the published layout and the settings the
published performance recipes use (bf16 gradient reduction, FP8 weights under FP8/MXFP8, no recompute
beyond the modules a run recomputes selectively), so ``plan`` can be compared with what NVIDIA measured. MoE rows take each run's dispatcher and EP overlap
and DeepSeek-V3's pipeline layout from Megatron-Bridge's performance configs of the same release
(``scripts/performance/configs/*/*_workload_base_configs.py`` and ``*_llm_pretrain.py``); what a run used
that a recipe cannot say is listed per row (``RUNS[...].unmodelled``). Run
``python benchmarks/published_throughput.py`` for every row's published figure, our estimate and their ratio.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

TABLE = Path(__file__).parent / "data" / "published_throughput.csv"
RECIPES = {
    "LLAMA3_70B": "llama3_70b_pretrain",
    "LLAMA3.1_405B": "llama31_405b_pretrain",
    "DeepSeekV3": "deepseek_v3_pretrain",
    "Qwen3_30B_a3B": "qwen3_30b_a3b_pretrain",
    "Qwen3_235B_a22B": "qwen3_235b_a22b_pretrain",
}
# DeepSeek-V3's 61 layers + MTP over (pp, vp) as the published runs split them: Megatron-Bridge's
# set_deepseek_v3_pipeline_model_parallel_layout, or the config's own pp_layout (GB300 and B200)
LAYOUTS = {
    ("DeepSeekV3", 2, 8): "Et*4|(t*4|)*14tmL",
    ("DeepSeekV3", 4, 4): "Et*4|(t*4|)*14tmL",
    ("DeepSeekV3", 8, 2): "Et*4|(t*4|)*14tmL",
    ("DeepSeekV3", 8, 0): "Et*8|(t*8|)*6t*5mL",
}


@dataclass(frozen=True)
class Run:
    """What a published MoE run set beyond its layout: token dispatcher, EP overlap (``moe_a2a_overlap``:
    overlap_moe_expert_parallel_comm with delay_wgrad_compute), the modules it recomputes (selective
    recompute_modules), and what no recipe field expresses yet."""

    dispatcher: str = "flex"  # flex | alltoall
    backend: str = "hybridep"  # flex only: hybridep | deepep
    overlap: bool = False
    recompute: tuple = ()  # recompute_modules; () = none
    unmodelled: tuple = ()


_NO_TP_OVERLAP = "tp_comm_overlap off (the plan assumes TP 25% exposed)"
RUNS = {  # (system, model) -> Run; rows not listed (dense models) need none
    # DeepSeek-V3: deepseek_workload_base_configs.py's V2 presets (GBS 4096) for FP8_MX, its recompute_modules
    # with recompute_granularity "selective" (set_deepseek_v3_common_configs); Qwen3's runs recompute nothing
    ("DGX-GB300", "DeepSeekV3"): Run(recompute=("mla_up_proj",)),
    ("DGX-GB200", "DeepSeekV3"): Run(recompute=("mlp",), unmodelled=("CUDA graphs (attn, router)",)),
    ("DGX-B300", "DeepSeekV3"): Run(recompute=("mla_up_proj",), unmodelled=("CUDA graphs (attn, router)",)),
    ("DGX-B200", "DeepSeekV3"): Run(backend="deepep", overlap=True, recompute=("mla_up_proj", "mlp"),
                                    unmodelled=("CUDA graphs (attn, router)",)),
    **{(system, "Qwen3_30B_a3B"): Run(unmodelled=("CUDA graphs (router)",)) for system in ("DGX-GB300", "DGX-GB200", "DGX-B300")},
    ("DGX-B200", "Qwen3_30B_a3B"): Run(unmodelled=("CUDA graphs (attn, router)",)),
    ("DGX-H100", "Qwen3_30B_a3B"): Run(),
    ("DGX-GB300", "Qwen3_235B_a22B"): Run(unmodelled=("CUDA graphs (attn, router)",)),
    ("DGX-GB200", "Qwen3_235B_a22B"): Run(unmodelled=("CUDA graphs (attn, router)",)),
    ("DGX-B300", "Qwen3_235B_a22B"): Run(),
    ("DGX-B200", "Qwen3_235B_a22B"): Run(dispatcher="alltoall"),
    ("DGX-H100", "Qwen3_235B_a22B"): Run(dispatcher="alltoall", overlap=True, unmodelled=(_NO_TP_OVERLAP,)),
}
CLUSTERS = {  # system -> (cluster group, GPUs per node)
    "DGX-H100": ("h100_8gpu", 8),
    "DGX-B200": ("b200_8gpu", 8),
    "DGX-B300": ("b300_8gpu", 8),
    "DGX-GB200": ("gb200_nvl72", 4),
    "DGX-GB300": ("gb300_nvl72", 4),
}
PRECISIONS = {  # published precision -> (precision group, extra overrides as the published presets set)
    "FP8": ("fp8_tensorwise", ["precision.fp8_param_gather=true"]),
    "MXFP8": ("mxfp8", ["precision.fp8_param_gather=true"]),
    "NVFP4": ("nvfp4", []),
    "BF16": ("bf16", []),
}


@dataclass(frozen=True)
class Row:
    system: str
    model: str
    gpus: int
    precision: str
    gbs: int
    mbs: int
    seq: int
    fsdp: int
    tp: int
    pp: int
    cp: int
    vp: int
    ep: int
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float

    @property
    def label(self) -> str:
        return f"{self.system} {self.model} {self.precision} x{self.gpus}"


def load(path: Path = TABLE) -> List[Row]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    out = []
    for rec in csv.DictReader(lines):
        out.append(Row(rec["system"], rec["model"], *(int(rec[k]) for k in ("gpus",)), rec["precision"],
                       *(int(rec[k]) for k in ("gbs", "mbs", "seq", "fsdp", "tp", "pp", "cp", "vp", "ep")),
                       float(rec["tokens_per_s_per_gpu"]), float(rec["model_tflops_per_gpu"])))
    return out


def _split_overrides(layers: int, pp: int, vp: int) -> Optional[List[str]]:
    """Overrides that split ``layers`` over pp x vp the way megatron-core accepts, or None."""
    v = max(1, vp)
    plain = ["parallel.num_layers_in_first_pipeline_stage=null", "parallel.num_layers_in_last_pipeline_stage=null"]
    if layers % (pp * v) == 0:
        return plain
    if (layers + 2) % (pp * v) == 0:
        return plain + ["parallel.account_for_embedding_in_pipeline_split=true", "parallel.account_for_loss_in_pipeline_split=true"]
    if pp > 2 and vp == 0:
        middle = -(-layers // pp)
        rest = layers - (pp - 2) * middle
        if rest >= 2:
            return [f"parallel.num_layers_in_first_pipeline_stage={rest - rest // 2}",
                    f"parallel.num_layers_in_last_pipeline_stage={rest // 2}"]
    return None


def overrides(row: Row, num_layers: int) -> tuple[Optional[List[str]], str]:
    """(the row as ``plan`` overrides, or None with the reason it cannot be planned yet)."""
    if row.fsdp:
        return None, "FSDP is not in the recipes yet"
    layout = LAYOUTS.get((row.model, row.pp, row.vp))
    split = [f"parallel.pipeline_layout='{layout}'"] if layout else _split_overrides(num_layers, row.pp, row.vp)
    if split is None:
        return None, f"{num_layers} layers do not split over pp={row.pp} x vp={row.vp} without a pipeline layout"
    if not layout:
        split.append("parallel.pipeline_layout=null")
    cluster, per_node = CLUSTERS[row.system]
    group, extra = PRECISIONS[row.precision]
    modules = RUNS[(row.system, row.model)].recompute if (row.system, row.model) in RUNS else ()
    recompute = (["train.recompute=selective", f"train.recompute_modules=[{','.join(modules)}]"] if modules
                 else ["train.recompute=none", "train.recompute_modules=[core_attn]"])
    out = [
        f"cluster={cluster}", f"cluster.nodes={row.gpus // per_node}", f"precision={group}", *extra,
        "precision.grad_reduce_in_fp32=false", f"parallel.tp={row.tp}", f"parallel.pp={row.pp}",
        f"parallel.cp={row.cp}", f"parallel.vpp={row.vp or 'null'}", f"parallel.sp={str(row.tp > 1).lower()}",
        f"train.global_batch_size={row.gbs}", f"train.micro_batch_size={row.mbs}", f"train.seq_length={row.seq}",
        *recompute, *split,
    ]
    if row.ep:
        run = RUNS[(row.system, row.model)]
        overlap = str(run.overlap).lower()
        out += [f"parallel.ep={row.ep}", "parallel.etp=1", "parallel.allow_inter_node_ep=true",
                f"parallel.moe_dispatcher={run.dispatcher}", f"parallel.moe_flex_backend={run.backend}",
                f"parallel.overlap_moe_expert_parallel_comm={overlap}", f"parallel.delay_wgrad_compute={overlap}"]
    return out, ""


def unmodelled(row: Row) -> tuple:
    """What the published run used that the plan of the row does not model. The EP exchange's achieved rate
    is fitted to DGX-H100 rows alone (estimate/rates.py): on other systems it is the H100 figure applied to
    their links, whatever kernel (HybridEP, DeepEP) the run used."""
    run = RUNS.get((row.system, row.model))
    if run is None:
        return ()
    if row.ep and row.system != "DGX-H100":
        kernel = run.backend if run.dispatcher == "flex" else run.dispatcher
        return run.unmodelled + (f"{kernel} exchange rate on {row.system} (EP calibrated on DGX-H100 only)",)
    return run.unmodelled

"""The presets' host optimizer rates are a measured per-core rate per configuration times a tagged
scaling assumption, and ``layerwise plan`` prints the optimizer time that follows from them."""

import importlib.util
import re
from pathlib import Path

from layerwise.cli import main
from layerwise.planner.host_rates import CONFIGS, PER_CORE_GPARAM_S, PRESET_HOSTS, config_name
from layerwise.plan.shape import load_shape

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    """``benchmarks/host_optimizer.py`` as a module (its ``main`` is guarded: importing runs nothing)."""
    spec = importlib.util.spec_from_file_location("host_optimizer_bench", ROOT / "benchmarks" / "host_optimizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _documented_1thread_gparam_s() -> dict[str, float]:
    """The 1-thread column of the benchmark's documented run (docs/results.md, its table by
    configuration)."""
    text = (ROOT / "docs" / "results.md").read_text()
    section = text[text.index("### Host optimizer by configuration"):]
    section = section[:section.index("\n#", 1)]
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| `([\w-]+)` \| ([\d.]+) \|", section, re.M)}


def test_configuration_names_are_the_benchmarks_and_the_per_core_rates_its_measurement():
    """Every configuration the planner prices is one ``benchmarks/host_optimizer.py`` runs (its
    runs are built from the same names), and each per-core rate is that configuration's 1-thread
    figure in the benchmark's documented run."""
    bench = _benchmark()
    ran = {config_name(m, g, master, clip != 1.0) for m, g, master, clip in bench.configs()}
    assert set(PER_CORE_GPARAM_S) == {config_name(*c) for c in CONFIGS} <= ran
    documented = _documented_1thread_gparam_s()
    assert set(documented) == ran
    assert {n: documented[n] for n in PER_CORE_GPARAM_S} == PER_CORE_GPARAM_S


def test_plan_prints_the_optimizer_time_of_the_per_core_rate_times_the_tagged_scaling(capsys):
    """qwen2.5-14b on an h200 with 128 GB of host RAM: the plan lands each gradient once (bf16
    host gradients, split master, 8-bit moments everywhere), and its optimizer time per step is
    the parameters / (the benchmark's per-core rate of ``8bit-bf16grad-split`` x the printed
    cores, capped by the printed bus / the configuration's 14 bytes a parameter) within 1%,
    both in the busy line and in the optimizer line, which says the scaling is assumed.

    Mutation seen caught: the memory-bandwidth cap dropped from
    ``HostAssumption.rate_gparam_s`` (the plan then prints 0.28 s a step, not 1.38)."""
    rc = main(["plan", "--model", "qwen2.5-14b", "--hardware", "h200", "--seq-len", "4096", "--host-mem", "128"])
    out = capsys.readouterr().out
    assert rc == 0
    busy_s = float(re.search(r"^busy per step: .*optimizer ([\d.]+)s", out, re.M).group(1))
    line = re.search(r"^optimizer (\S+): ([\d.]+) Gparam/s \(assumed: (\d+) cores x ([\d.]+) Gparam/s per core "
                     r"\(measured on [^)]*\)[^,]*, capped by memory bandwidth: ([\d.]+) GB/s / (\d+) B per param\); "
                     r"(\d+) units, [\d.]+B params: ([\d.]+) s per step$", out, re.M)
    assert line, out[-1500:]
    name, _, cores, per_core, stream_gbps, nbytes, units, line_s = line.groups()
    assert name == "8bit-bf16grad-split" and "priced at" not in line.group(0)
    assert float(per_core) == _documented_1thread_gparam_s()[name] == PER_CORE_GPARAM_S[name]
    assert int(cores) == PRESET_HOSTS["h200"].optimizer_cores and int(nbytes) == 8 + 2 + 4
    shape = load_shape("qwen2.5-14b")
    assert int(units) == len(shape.unit_names())  # every unit 8-bit: the only moments line
    rate_gparam_s = min(int(cores) * float(per_core), float(stream_gbps) / int(nbytes))
    want_s = sum(shape.trainable_params(u) for u in shape.unit_names()) / (rate_gparam_s * 1e9)
    assert abs(busy_s / want_s - 1) < 0.01 and abs(float(line_s) / want_s - 1) < 0.01, (busy_s, line_s, want_s)

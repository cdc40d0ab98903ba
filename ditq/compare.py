"""Fidelity against the baseline: PSNR, SSIM (and LPIPS where its weights are on disk), per image.

For every successful baseline record, the candidate image with the same fixture
and seed is compared: RGBA with RGBA when both images carry alpha, otherwise
both composited over white. A missing candidate image is a ``missing`` row; a
size mismatch is an ``error`` row. Per fixture: mean, min, max.

The parity band answers "is this as close as two acceptable BF16 runs are to each
other?": its edge is the mean PSNR of a reference pair (two BF16 runs of
different implementations or settings), or a number the user states, minus a
tolerance. A candidate fixture whose mean PSNR reaches the edge is inside.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ditq.metrics import fidelity_arrays, load_png_array, psnr, ssim
from ditq.probe.records import changed_fixtures, find_image, is_success, latest_by_key, read_records

__all__ = [
    "PSNR_CAP_DB",
    "CompareResult",
    "ParityBand",
    "compare_run",
    "format_compare",
    "lpips_scorer",
    "parity_from_pair",
]

log = logging.getLogger(__name__)

PSNR_CAP_DB = 100.0  # identical images (infinite PSNR) are reported at this value so means stay finite
_ALEXNET_WEIGHTS = "alexnet-owt-7be5be79.pth"  # what torchvision (and so lpips) loads for AlexNet

LpipsScorer = Callable[[np.ndarray, np.ndarray], float]


def lpips_scorer() -> tuple[LpipsScorer | None, str]:
    """(scorer, note). The scorer exists only when the lpips package and the AlexNet weights are local."""
    if importlib.util.find_spec("lpips") is None:
        return None, "lpips skipped: the lpips package is not installed"
    import torch

    weights = Path(torch.hub.get_dir()) / "checkpoints" / _ALEXNET_WEIGHTS
    if not weights.is_file():
        return None, f"lpips skipped: AlexNet weights not found at {weights} (they are never downloaded)"
    import lpips

    network = lpips.LPIPS(net="alex", verbose=False).eval()

    def score(a: np.ndarray, b: np.ndarray) -> float:
        def tensor(x: np.ndarray) -> torch.Tensor:  # (H, W, 3) uint8 -> (1, 3, H, W) in [-1, 1]
            return torch.from_numpy(x[..., :3].astype(np.float32) / 127.5 - 1.0).permute(2, 0, 1)[None]

        with torch.no_grad():
            return float(network(tensor(a), tensor(b)).item())

    return score, "lpips: AlexNet"


@dataclass(frozen=True)
class ParityBand:
    source: str  # "pair A vs B" or "stated"
    overall_db: float
    per_fixture_db: dict[str, float]
    tolerance_db: float

    def edge(self, fixture_id: str | None) -> float:
        value = self.per_fixture_db.get(fixture_id, self.overall_db) if fixture_id else self.overall_db
        return value - self.tolerance_db


@dataclass
class CompareResult:
    run: str
    baseline: str
    baseline_seal: str
    lpips_note: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    fixtures: dict[str, dict[str, Any]] = field(default_factory=dict)
    overall: dict[str, Any] = field(default_factory=dict)
    parity: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _stats(values: list[float], digits: int) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {
        "mean": round(statistics.fmean(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def _compare_pair(candidate: Path, reference: Path, scorer: LpipsScorer | None) -> dict[str, Any]:
    try:
        a, a_mode = load_png_array(reference.read_bytes())
    except Exception as error:  # an unreadable file is a row of its own, not the end of the comparison
        return {"status": "error", "error": f"baseline image cannot be decoded ({type(error).__name__})"}
    try:
        b, b_mode = load_png_array(candidate.read_bytes())
    except Exception as error:
        return {"status": "error", "error": f"image cannot be decoded ({type(error).__name__})"}
    if a.shape[:2] != b.shape[:2]:
        return {
            "status": "error",
            "error": f"size {b.shape[1]}x{b.shape[0]} vs baseline {a.shape[1]}x{a.shape[0]}",
        }
    x, y = fidelity_arrays(a, b, "RGBA" if a.shape[2] == 4 else a_mode, "RGBA" if b.shape[2] == 4 else b_mode)
    row: dict[str, Any] = {
        "status": "ok",
        "psnr_db": round(min(psnr(x, y), PSNR_CAP_DB), 3),
        "ssim": round(ssim(x, y), 5),
        "space": "RGBA" if x.shape[2] == 4 else "RGB over white",
    }
    if scorer is not None:
        row["lpips"] = round(scorer(x, y), 5)
    return row


_SETTINGS = ("steps", "true_cfg_scale", "size")  # what must agree for two images to be comparable


def _has_records(run: Path) -> bool:
    return any(Path(run).glob("records.jsonl")) or any(Path(run).glob("matrix*.json"))


def _settings_mismatch(candidate: dict[str, Any] | None, baseline: dict[str, Any]) -> str:
    """'steps 4 vs baseline 20, ...' where the candidate's record says it was made differently."""
    if candidate is None:
        return ""
    return ", ".join(
        f"{key} {candidate[key]} vs baseline {baseline[key]}"
        for key in _SETTINGS
        if candidate.get(key) is not None
        and baseline.get(key) is not None
        and candidate[key] != baseline[key]
    )


def compare_run(
    run: Path,
    baseline: Path,
    *,
    baseline_seal: str = "sealed",
    parity: ParityBand | None = None,
    use_lpips: bool = True,
) -> CompareResult:
    scorer, note = lpips_scorer() if use_lpips else (None, "lpips skipped: not requested")
    result = CompareResult(run=str(run), baseline=str(baseline), baseline_seal=baseline_seal, lpips_note=note)
    candidates = latest_by_key(read_records(run)) if _has_records(run) else {}
    changed = changed_fixtures(run, baseline)
    for (fixture_id, seed), record in latest_by_key(read_records(baseline)).items():
        if not is_success(record):
            continue
        reference = find_image(baseline, fixture_id, seed)
        row: dict[str, Any] = {
            "fixture_id": fixture_id,
            "seed": seed,
            "n_references": record.get("n_references"),
        }
        candidate = find_image(run, fixture_id, seed)
        mismatch = _settings_mismatch(candidates.get((fixture_id, seed)), record)
        if reference is None:
            row.update(status="error", error="baseline image missing")
        elif candidate is not None and mismatch:
            row.update(status="error", error=f"made with other settings: {mismatch}")
        elif candidate is not None and fixture_id in changed:
            row.update(
                status="error", error="the fixture (prompt, size or references) differs from the baseline's"
            )
        elif candidate is None:
            row.update(status="missing")
        else:
            row.update(_compare_pair(candidate, reference, scorer))
        result.rows.append(row)
    for fixture_id in dict.fromkeys(r["fixture_id"] for r in result.rows):
        rows = [r for r in result.rows if r["fixture_id"] == fixture_id]
        ok = [r for r in rows if r["status"] == "ok"]
        entry: dict[str, Any] = {
            "n": len(rows),
            "ok": len(ok),
            "missing": sum(r["status"] == "missing" for r in rows),
            "errors": sum(r["status"] == "error" for r in rows),
            "psnr_db": _stats([r["psnr_db"] for r in ok], 2),
            "ssim": _stats([r["ssim"] for r in ok], 4),
        }
        if scorer is not None:
            entry["lpips"] = _stats([r["lpips"] for r in ok], 4)
        if parity is not None and ok:
            edge = parity.edge(fixture_id)
            entry["parity_edge_db"] = round(edge, 2)
            entry["inside_parity_band"] = entry["psnr_db"]["mean"] >= edge
        result.fixtures[fixture_id] = entry
    ok_rows = [r for r in result.rows if r["status"] == "ok"]
    result.overall = {
        "n": len(result.rows),
        "ok": len(ok_rows),
        "psnr_db": _stats([r["psnr_db"] for r in ok_rows], 2),
        "ssim": _stats([r["ssim"] for r in ok_rows], 4),
    }
    if parity is not None:
        inside = [e["inside_parity_band"] for e in result.fixtures.values() if "inside_parity_band" in e]
        result.parity = {
            "source": parity.source,
            "overall_db": round(parity.overall_db, 2),
            "per_fixture_db": {k: round(v, 2) for k, v in parity.per_fixture_db.items()},
            "tolerance_db": parity.tolerance_db,
            "inside": bool(inside) and all(inside) and len(ok_rows) == len(result.rows),
        }
    return result


def parity_from_pair(first: Path, second: Path, tolerance_db: float) -> ParityBand:
    """The band two acceptable runs span: their mean PSNR to each other, per fixture and overall."""
    pair = compare_run(second, first, use_lpips=False)
    if not pair.overall["ok"]:
        from ditq.errors import InputError

        raise InputError(f"--parity-pair: {first} and {second} share no comparable images")
    per_fixture = {k: v["psnr_db"]["mean"] for k, v in pair.fixtures.items() if v["ok"]}
    return ParityBand(f"pair {first} vs {second}", pair.overall["psnr_db"]["mean"], per_fixture, tolerance_db)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_compare(results: Sequence[CompareResult]) -> str:
    lines = []
    for res in results:
        lines.append(f"== {res.run} vs {res.baseline} (baseline {res.baseline_seal}) ==")
        for row in res.rows:
            head = f"    {row['fixture_id']} s{row['seed']}: "
            if row["status"] == "ok":
                extra = f" lpips {row['lpips']:.4f}" if "lpips" in row else ""
                lines.append(
                    head + f"PSNR {row['psnr_db']:.2f} dB  SSIM {row['ssim']:.4f}{extra}  ({row['space']})"
                )
            else:
                lines.append(head + row["status"].upper() + (f": {row['error']}" if row.get("error") else ""))
        for fixture_id, e in res.fixtures.items():
            p, s = e["psnr_db"], e["ssim"]
            band = ""
            if "inside_parity_band" in e:
                band = f"  {'inside' if e['inside_parity_band'] else 'OUTSIDE'} parity band (edge {e['parity_edge_db']:.2f} dB)"
            lines.append(
                f"  {fixture_id}: n={e['n']} ok={e['ok']} missing={e['missing']} errors={e['errors']}  "
                f"PSNR mean {_fmt(p['mean'], '.2f')} [{_fmt(p['min'], '.2f')}, {_fmt(p['max'], '.2f')}] dB  "
                f"SSIM mean {_fmt(s['mean'], '.4f')}{band}"
            )
        lines.append(f"  {res.lpips_note}")
        o = res.overall["psnr_db"]
        lines.append(
            f"  overall: {res.overall['ok']}/{res.overall['n']} compared, PSNR mean {_fmt(o['mean'], '.2f')} dB"
        )
        if res.parity is not None:
            lines.append(
                f"  parity band ({res.parity['source']}, {res.parity['overall_db']:.2f} dB, tolerance "
                f"{res.parity['tolerance_db']:g} dB): {'INSIDE' if res.parity['inside'] else 'OUTSIDE'}"
            )
    return "\n".join(lines)

"""`ditq doctor`: a thin layer over ``ditq.doctor.run_doctor``; exit 0 only when no checked path fails."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ditq.commands import ATTENTION_CHOICES
from ditq.devices import DTYPE_CHOICES, add_device_arguments, resolve_device, resolve_dtype
from ditq.errors import InputError
from ditq.report.provenance import shell_command
from ditq.runfiles import DoctorFile, to_json, write_model

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--artifact", type=Path, metavar="PATH", help="check with this artifact's own layers and shapes"
    )
    parser.add_argument(
        "--scheme", nargs="+", metavar="S", help="only these schemes (w8a16, w8a8, fp8, w4a16, w4a8)"
    )
    parser.add_argument("--kernels", nargs="+", metavar="K", help="only these kernel paths (names as listed)")
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="also use random synthetic weights (implied without --artifact)",
    )
    add_device_arguments(parser, "auto", "device to check")
    parser.add_argument(
        "--geometry",
        nargs="+",
        metavar="INxOUT",
        help="Linear shapes to check without an artifact (default: the seed's 4096x12288 4096x4096 12288x4096)",
    )
    parser.add_argument(
        "--rows", type=int, default=512, metavar="M", help="tokens per checked matmul (default 512)"
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=DTYPE_CHOICES,
        metavar="DTYPE",
        help="the activation dtypes to check each path at, where it takes them: the one a server computes in, say "
        "(ditq sweep gives its servers'; default: bfloat16 float16)",
    )
    parser.add_argument(
        "--attention",
        nargs="+",
        choices=ATTENTION_CHOICES,
        metavar="KIND",
        help="also check the quantized-attention paths of these kinds (int8, fp8, int8-fp8) for this device",
    )
    parser.add_argument(
        "--head-dim",
        type=int,
        default=128,
        metavar="D",
        help="head dim of the attention checks (default 128)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="write every check as JSON ('-' for stdout)"
    )
    parser.add_argument(
        "--report", type=Path, metavar="DIR", help="write a report directory per failing path under DIR"
    )


def _geometry(text: str):
    from ditq.doctor import Geometry

    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise InputError(f"--geometry {text!r}: expected INxOUT, e.g. 4096x12288")
    return Geometry(int(parts[0]), int(parts[1]))


def run(args: argparse.Namespace) -> int:
    from ditq import doctor
    from ditq.schemes import get_scheme

    device = resolve_device(args.device)
    schemes = [get_scheme(s).name for s in args.scheme] if args.scheme else None
    report_root = args.report if args.report is not None else doctor.cache_dir() / "reports"
    geometries = [_geometry(text) for text in args.geometry] if args.geometry else doctor.SEED_GEOMETRIES
    if args.rows <= 0:
        raise InputError(f"--rows must be positive, got {args.rows}")
    results = doctor.run_doctor(
        device,
        args.artifact,
        schemes,
        args.kernels,
        synthetic=args.synthetic,
        report_root=report_root,
        geometries=geometries,
        rows=args.rows,
        dtypes=tuple(resolve_dtype(name, device) for name in args.dtype)
        if args.dtype
        else doctor.CHECK_DTYPES,
    )
    if args.attention:
        from ditq.doctor.attention import run_attention_doctor

        if args.head_dim <= 0:
            raise InputError(f"--head-dim must be positive, got {args.head_dim}")
        results += run_attention_doctor(device, args.attention, args.head_dim)
    env = doctor.environment(device)
    payload = DoctorFile(command=shell_command(), environment=env, bound=doctor.REL_L2_BOUND, paths=results)
    if args.json is not None and str(args.json) == "-":
        print(json.dumps(to_json(payload), indent=1))
    else:
        print(f"ditq doctor on {env.gpu or env.device} (torch {env.torch}, triton {env.triton})")
        print(doctor.table(results))
        for r in results:
            if r.report_dir:
                print(f"{r.path}: report in {r.report_dir}; reproduce with: {doctor.repro_command(r.path)}")
        if args.json is not None:
            write_model(args.json, payload)
    return 1 if any(r.verdict == "FAIL" for r in results) else 0

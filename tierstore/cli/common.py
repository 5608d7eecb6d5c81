"""What every command that reads the configuration shares: its flags and the
``Config`` they give.

Provides ``add_config_flags`` (``--config``, ``--set NAME=VALUE`` and the
shortcuts ``--socket``, ``--dram-bytes``, ...) and ``config_from_args``
(the effective ``Config``: TOML < environment < those flags). ``cli.main``
and the command modules import it; it imports no command.

Runs in the foreground of the shell that calls ``tierstore``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from tierstore.config import SECTIONS, Config, load_config
from tierstore.errors import TierstoreError


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config file")
    parser.add_argument(
        "--set",
        metavar="NAME=VALUE",
        action="append",
        default=[],
        help="override one setting (repeatable), e.g. --set dram_bytes=4GiB",
    )
    for flag, name, help_text in (
        ("--socket", "socket_path", "Unix socket of the sidecar"),
        ("--dram-bytes", "dram_bytes", "size of the DRAM arena, e.g. 8GiB"),
        ("--nvme-dir", "nvme_dir", "directory of the NVMe tier"),
        ("--nvme-bytes", "nvme_bytes", "NVMe budget, e.g. 200GiB; 0 disables the tier"),
        ("--metrics-port", "metrics_port", "Prometheus port; 0 disables it"),
        ("--remote-url", "remote_url", "remote tier bucket, s3://bucket/prefix (credentials: env)"),
        ("--remote-endpoint", "remote_endpoint", "S3 endpoint of a non-AWS store, https://..."),
    ):
        parser.add_argument(flag, dest=name, default=None, help=help_text)


def config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {}
    for section in SECTIONS.values():
        for name in (f.name for f in dataclasses.fields(section)):
            value = getattr(args, name, None)
            if value is not None:
                overrides[name] = value
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise TierstoreError(f"--set needs NAME=VALUE, got {item!r}")
        overrides[name.strip()] = value.strip()
    return load_config(args.config, overrides=overrides)

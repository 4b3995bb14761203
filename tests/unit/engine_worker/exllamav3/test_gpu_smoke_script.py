"""``scripts/gpu_smoke.py`` helpers that need no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import gpu_smoke


def test_conversion_without_output_fails_with_the_converter_log(tmp_path: Path) -> None:
    # convert_model.py (1.6.5) prints " !! Error: ..." for a bad argument and exits 0
    log = tmp_path / "convert.log"
    log.write_text(" -- Loading\n !! Error: unknown option -cc\n")
    with pytest.raises(RuntimeError, match="unknown option -cc") as e:
        gpu_smoke.check_converted(tmp_path / "exl3", log)
    assert "config.json" in str(e.value)


def test_conversion_with_config_json_passes(tmp_path: Path) -> None:
    out = tmp_path / "exl3"
    out.mkdir()
    (out / "config.json").write_text("{}")
    gpu_smoke.check_converted(out, tmp_path / "convert.log")

import torch

from forge import precision


def test_bf16_request_falls_back_to_fp32_on_a_cpu_without_bf16_units(monkeypatch, capsys):
    monkeypatch.setattr(precision, "bf16_fast", lambda device: False)
    precision._warn_once.cache_clear()
    assert precision.bf16_autocast(True, "cpu", "update.autocast_bf16") is False
    assert precision.bf16_autocast(True, "cpu", "update.autocast_bf16") is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "update.autocast_bf16=true" in err[0] and "fp32" in err[0]  # said once


def test_bf16_request_kept_where_the_device_has_bf16_units(monkeypatch, capsys):
    monkeypatch.setattr(precision, "bf16_fast", lambda device: True)
    assert precision.bf16_autocast(True, "cpu", "rollout.autocast_bf16") is True
    assert precision.bf16_autocast(False, "cpu", "rollout.autocast_bf16") is False
    assert capsys.readouterr().err == ""


def test_cpu_detection_agrees_with_torch():
    cpu = torch.cpu
    expected = cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
    assert precision.bf16_fast("cpu") == expected

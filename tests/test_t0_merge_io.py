"""T0: lazy safetensors inputs, architecture detection, file errors, the atomic writer, LoRA key mapping."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.t0

SD_PROBE = "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"
SD15_LORAS = [f"patchbay-{kind}" for kind in ("lora-r4", "lora-r16", "locon-r4", "locon-r8", "loha-r4",
                                               "loha-r8", "lokr-r4", "lokr-r8")]


@pytest.fixture(scope="module")
def mio():
    from patchbay_merge import io

    return io


def test_reads_every_tensor_lazily_and_exactly(mio, tmp_path):
    tensors = {"a.weight": torch.randn(3, 5).half(), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(2, 2, 3, 3).to(torch.bfloat16), "scalar": torch.tensor(2.5)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"k": "v"})
    file = mio.SafetensorsFile(tmp_path / "x.safetensors")
    assert file.metadata == {"k": "v"} and file.arch == "unknown"
    buffer = torch.empty(1024, dtype=torch.uint8)
    for key, expected in tensors.items():
        assert torch.equal(file.read_into(key, buffer), expected) and torch.equal(file.read(key), expected)
    file.close()


def test_a_mapped_tensor_reads_the_file_in_place_and_never_writes_it(mio, tmp_path):
    tensors = {"a.weight": torch.randn(3, 5).half(), "big": torch.randn(70_000), "empty": torch.zeros(0, 4)}
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    before = path.read_bytes()
    file = mio.SafetensorsFile(path)
    for key, expected in tensors.items():
        assert torch.equal(file.map(key), expected)
    assert torch.equal(file.map("big", 65_536, 70_000), tensors["big"][65_536:])  # a slice, flat
    mapped = file.map("big")
    mapped.mul_(2)  # a method that wrote into its input would change this process's copy only
    assert path.read_bytes() == before
    os.truncate(path, len(before) - 100)  # the file shrank while merging: an error, never a crash
    with pytest.raises(mio.ModelFileError, match="ends inside tensor 'big'.*Fetch the file again"):
        file.map("big")
    file.close()


def test_the_writer_starts_writeback_as_it_goes_and_fsyncs_at_the_end(mio, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(mio, "WRITE_BACK_BYTES", 1000)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, start, length, advice: calls.append((start, length)),
                        raising=False)
    tensors = {f"t{i}": torch.randn(100) for i in range(8)}  # 400 bytes each
    planned = [mio.OutputTensor(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    with mio.SafetensorsWriter(tmp_path / "out.safetensors", planned, {}) as writer:
        for key, tensor in tensors.items():
            writer.append(key, tensor)
        writer.commit()
    start = writer.data_start
    assert calls == [(start, 1200), (start + 1200, 1200)]  # every 1000 bytes or more, in order
    loaded = load_file(str(tmp_path / "out.safetensors"))
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items())
    calls.clear()
    with mio.SafetensorsWriter(tmp_path / "nosync.safetensors", planned, {}, fsync=False) as writer:
        for key, tensor in tensors.items():
            writer.append(key, tensor)
        writer.commit()
    assert calls == []  # fsync off: nothing forces the data to disk


@pytest.mark.parametrize(("keys", "arch", "unet_only"), [
    ({"model.diffusion_model." + SD_PROBE: (320, 768)}, "sd15", False),
    ({SD_PROBE: (320, 768)}, "sd15", True),
    ({"model.diffusion_model." + SD_PROBE: (640, 2048)}, "sdxl", False),
    ({SD_PROBE: (640, 2048), "label_emb.0.0.weight": (1280, 2816)}, "sdxl", True),
    ({"model.diffusion_model.double_blocks.0.img_attn.qkv.weight": (9, 3)}, "flux", False),
    ({"double_blocks.0.img_attn.qkv.weight": (9, 3)}, "flux", True),
    ({"lora_unet_x.lora_down.weight": (4, 8), "lora_unet_x.lora_up.weight": (8, 4)}, "lora-kohya", False),
    ({"lora_unet_x.hada_w1_a": (8, 4)}, "lora-lycoris", False),
    ({"lora_unet_x.lokr_w1": (2, 2)}, "lora-lycoris", False),
    ({"something.else": (2,)}, "unknown", False),
])
def test_architecture_detection(mio, keys, arch, unet_only):
    infos = {k: mio.TensorInfo("F16", shape, 0, 0) for k, shape in keys.items()}
    assert mio.detect_architecture(infos) == (arch, unet_only)


def test_tiny_models_are_detected(mio, models):
    assert mio.SafetensorsFile(models.checkpoints["patchbay-sd15-tiny-a"]).arch == "sd15"
    kinds = {name: mio.SafetensorsFile(models.loras[name]).arch for name in SD15_LORAS}
    assert {kinds[n] for n in kinds if "lora" in n or "locon" in n} == {"lora-kohya"}
    assert {kinds[n] for n in kinds if "loha" in n or "lokr" in n} == {"lora-lycoris"}


def test_tiny_sdxl_and_flux_models_and_their_loras(mio, models):
    from patchbay_merge import lora

    root = models.root / "diffusion_models"
    sdxl, flux = (mio.SafetensorsFile(root / f"patchbay-{n}-tiny.safetensors") for n in ("sdxl", "flux"))
    assert (sdxl.arch, sdxl.unet_only, flux.arch, flux.unet_only) == ("sdxl", True, "flux", True)
    for base, name in ((sdxl, "patchbay-sdxl-locon-r8"), (flux, "patchbay-flux-kohya-r8")):
        source = lora.LoraSource(mio.SafetensorsFile(models.loras[name]), base)
        assert source.keys() and source.unmapped == [], name
    peft = mio.SafetensorsFile(models.loras["patchbay-flux-diffusers-r8"])
    assert peft.arch == "lora-peft"
    with pytest.raises(mio.ModelFileError, match="lora_A/lora_B"):
        lora.LoraSource(peft, flux)


def test_unet_only_keys_are_canonicalised(mio, tmp_path):
    save_file({SD_PROBE: torch.zeros(4, 768)}, str(tmp_path / "unet.safetensors"))
    file = mio.SafetensorsFile(tmp_path / "unet.safetensors")
    assert file.canonical_keys() == ["model.diffusion_model." + SD_PROBE]
    assert file.native("model.diffusion_model." + SD_PROBE) == SD_PROBE


def _good(tmp_path):
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "good.safetensors"))
    return (tmp_path / "good.safetensors").read_bytes()


@pytest.mark.parametrize(("mangle", "message"), [
    (lambda data: None, "no such file"),
    (lambda data: data[:5], "too short"),
    (lambda data: data[:-10], "truncated: .* bytes, the header needs"),
    (lambda data: data[:30], "truncated header"),
    (lambda data: (2**40).to_bytes(8, "little") + data[8:], "corrupt header length"),
    (lambda data: data[:8] + b"#" + data[9:], "corrupt header"),
    (lambda data: _with_header(data, {"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 12]}}),
     "spans 12 bytes, needs 16384"),
    (lambda data: _with_header(data, {"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}),
     "corrupt header entry"),
    (lambda data: _with_header(data, {"w": {"dtype": "F32", "shape": [-4, 4], "data_offsets": [64, 0]}}),
     "must be non-negative integers"),
    (lambda data: _with_header(data, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}}),
     "must be non-negative integers"),
    (lambda data: _pickled(), "is a pickle checkpoint .*only safetensors files are read.*st.save_file"),
    (lambda data: b"\x80\x02}q\x00X\x05\x00\x00\x00" + bytes(32), "is a pickle checkpoint"),
])
def test_bad_files_raise_an_error_naming_the_file_and_the_fix(mio, tmp_path, mangle, message):
    data = mangle(_good(tmp_path))
    path = tmp_path / "bad.safetensors"
    if data is not None:
        path.write_bytes(data)
    with pytest.raises(mio.ModelFileError, match=message) as error:
        mio.SafetensorsFile(path)
    assert str(path) in str(error.value) and error.value.fix


def _pickled() -> bytes:
    """What torch.save writes (a zip of pickles), the usual content of a .ckpt."""
    import io

    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.zeros(2)}}, buffer)
    return buffer.getvalue()


def _with_header(data: bytes, header: dict) -> bytes:
    length = int.from_bytes(data[:8], "little")
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + length:]


def test_mixed_architectures_are_refused_with_the_fix(mio, tmp_path):
    save_file({"model.diffusion_model." + SD_PROBE: torch.zeros(4, 768)}, str(tmp_path / "sd15.safetensors"))
    save_file({"model.diffusion_model." + SD_PROBE: torch.zeros(4, 2048)}, str(tmp_path / "sdxl.safetensors"))
    with pytest.raises(mio.ModelFileError, match="sdxl.safetensors: is a sdxl model but sd15.safetensors is "
                                                 "sd15.*one base"):
        mio.open_models([tmp_path / "sd15.safetensors", tmp_path / "sdxl.safetensors"])
    save_file({"some.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(mio.ModelFileError, match="other.safetensors: is a model of unknown architecture "
                                                 r"\(no keys of a known family\) but sd15.safetensors is "
                                                 "sd15"):
        mio.open_models([tmp_path / "sd15.safetensors", tmp_path / "other.safetensors"])


def test_writer_streams_and_renames_atomically(mio, tmp_path):
    tensors = {"b": torch.randn(3, 4), "a": torch.arange(5, dtype=torch.int32), "h": torch.randn(7).half()}
    planned = [mio.OutputTensor(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    out = tmp_path / "out.safetensors"
    with mio.SafetensorsWriter(out, planned, {"patchbay.recipe": "x"}) as writer:
        for key, tensor in tensors.items():
            writer.append(key, tensor)
        assert not out.exists() and writer.temp_path.exists()
        writer.commit()
    loaded = load_file(str(out))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert mio.SafetensorsFile(out).metadata == {"patchbay.recipe": "x"}
    assert os.listdir(tmp_path) == ["out.safetensors"]


def test_writer_allows_planned_keys_to_be_dropped(mio, tmp_path):
    planned = [mio.OutputTensor(k, torch.float32, (2, 2)) for k in ("x", "y", "z")]
    with mio.SafetensorsWriter(tmp_path / "out.safetensors", planned, {}) as writer:
        writer.append("x", torch.ones(2, 2))
        writer.append("z", torch.zeros(3))  # a shape that differs from the plan
        writer.commit()
    loaded = load_file(str(tmp_path / "out.safetensors"))
    assert set(loaded) == {"x", "z"} and loaded["z"].shape == (3,)


@pytest.mark.parametrize("exception", [RuntimeError, KeyboardInterrupt])
def test_writer_removes_its_temporary_file_on_error_and_never_overwrites(mio, tmp_path, exception):
    out = tmp_path / "out.safetensors"
    planned = [mio.OutputTensor("x", torch.float32, (2,))]
    with pytest.raises(exception), mio.SafetensorsWriter(out, planned, {}) as writer:
        writer.append("x", torch.ones(2))
        raise exception("stop")
    assert os.listdir(tmp_path) == []
    out.write_bytes(b"keep")
    with pytest.raises(FileExistsError, match="overwrite"):
        mio.SafetensorsWriter(out, planned, {})
    mio.save_file({"x": torch.ones(2)}, out, overwrite=True)
    assert torch.equal(load_file(str(out))["x"], torch.ones(2))


# ---- large outputs: data written around the page cache (merge/direct_write.py) ----------------------

ODD_TENSORS = {"a": (5000,), "b": (3, 7), "c": (9000,), "h": (4097,), "i": (333,)}  # 4-byte and 2-byte


def odd_tensors():
    g = torch.Generator().manual_seed(3)
    out = {k: torch.randn(shape, generator=g) for k, shape in ODD_TENSORS.items()}
    out["h"], out["i"] = out["h"].half(), (out["i"] * 100).to(torch.int32)
    return out


@pytest.fixture
def direct_small(mio, monkeypatch):
    """Every fsynced output written the direct way, through 8 KiB staging buffers (so a few tensors take
    many buffers and one tensor spans several)."""
    from patchbay_merge import direct_write

    monkeypatch.setattr(mio, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(direct_write, "STAGE_BYTES", 2 * direct_write.BLOCK)
    opened = []
    real_open = os.open

    def spying_open(path, flags, *args, **kwargs):
        opened.append(flags)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spying_open)
    return direct_write, opened


def takes_o_direct(folder) -> bool:
    probe = folder / "o_direct_probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def write_all(mio, path, tensors, **kwargs):
    planned = [mio.OutputTensor(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    with mio.SafetensorsWriter(path, planned, {"patchbay.recipe": "x"}, **kwargs) as writer:
        for key, tensor in tensors.items():
            writer.append(key, tensor)
        writer.commit()
    return writer


def test_a_large_output_is_written_around_the_page_cache_and_reads_back_exactly(mio, tmp_path, direct_small):
    direct_write, opened = direct_small
    tensors = odd_tensors()
    writer = write_all(mio, tmp_path / "out.safetensors", tensors)
    direct = takes_o_direct(tmp_path)
    assert writer.direct is direct and any(f & os.O_DIRECT for f in opened) is direct
    assert writer.data_start % direct_write.BLOCK == 0 and not [t for t in threading.enumerate()
                                                                if t.name == "patchbay-direct-write"]
    assert (tmp_path / "out.safetensors").stat().st_size == writer.position  # the padded tail cut off
    loaded = load_file(str(tmp_path / "out.safetensors"))
    assert list(loaded) == list(tensors) and all(torch.equal(loaded[k], t) for k, t in tensors.items())
    assert mio.SafetensorsFile(tmp_path / "out.safetensors").metadata == {"patchbay.recipe": "x"}
    opened.clear()
    small = write_all(mio, tmp_path / "nosync.safetensors", tensors, fsync=False)  # not fsynced: buffered
    assert small.direct is False and not any(f & os.O_DIRECT for f in opened)
    again = load_file(str(tmp_path / "nosync.safetensors"))
    assert all(torch.equal(again[k], loaded[k]) for k in tensors)


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_where_the_filesystem_refuses_o_direct_the_same_file_is_written_buffered(mio, tmp_path, direct_small,
                                                                               monkeypatch, refused_at):
    direct_write, _ = direct_small
    spying_open, real_pwrite, direct_fds, refused = os.open, os.pwrite, set(), []

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT and refused_at == "open":
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = spying_open(path, flags, *args, **kwargs)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refusing_pwrite(fd, data, offset):
        if fd in direct_fds and refused_at == "write":
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    tensors = odd_tensors()
    writer = write_all(mio, tmp_path / "out.safetensors", tensors)
    assert writer.direct is False and len(refused) == 1  # refused once, then buffered for good
    loaded = load_file(str(tmp_path / "out.safetensors"))
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items())
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors"]


@pytest.mark.parametrize("failure", ["disk full", "interrupt"])
def test_a_failed_or_interrupted_direct_write_leaves_no_file_and_no_thread(mio, tmp_path, direct_small,
                                                                          monkeypatch, failure):
    if not takes_o_direct(tmp_path):
        pytest.fail(f"{tmp_path} takes no O_DIRECT: this test needs a filesystem that does (ext4, xfs)")
    real_pwrite = os.pwrite

    def full_pwrite(fd, data, offset):
        if offset > 0 and len(data) == 2 * 4096:  # a staging buffer of the direct writer
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    if failure == "disk full":
        monkeypatch.setattr(os, "pwrite", full_pwrite)
    tensors = odd_tensors()
    planned = [mio.OutputTensor(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    expected = OSError if failure == "disk full" else KeyboardInterrupt
    with pytest.raises(expected), mio.SafetensorsWriter(tmp_path / "out.safetensors", planned, {}) as writer:
        for key, tensor in tensors.items():
            writer.append(key, tensor)
            if failure == "interrupt":
                raise KeyboardInterrupt
        writer.commit()
    assert os.listdir(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name == "patchbay-direct-write"]


def test_every_tiny_lora_module_maps_onto_a_checkpoint_key(mio, models):
    from patchbay_merge import lora

    base = mio.SafetensorsFile(models.checkpoints["patchbay-sd15-tiny-a"])
    for name in SD15_LORAS:
        source = lora.LoraSource(mio.SafetensorsFile(models.loras[name]), base)
        assert source.unmapped == [], name
        assert len(source.keys()) == (156 if name.startswith("patchbay-lora-") else 187), name
        key = "model.diffusion_model.input_blocks.1.1.proj_in.weight"
        delta, weight = source.delta(key), base.read(key).float()
        assert delta.shape == weight.shape
        assert 0.04 < float(delta.std() / weight.std()) < 0.08, name  # tiny_models: LORA_REL = 0.06


# SD1.5's diffusers names of a few modules far apart, written out by hand (diffusers' UNet2DConditionModel:
# up_blocks.0 has no attention, 3 resnets per up block, the upsampler after the third)
SD15_NAMES = {
    "input_blocks.0.0": "conv_in",
    "input_blocks.1.0.in_layers.2": "down_blocks_0_resnets_0_conv1",
    "input_blocks.3.0.op": "down_blocks_0_downsamplers_0_conv",
    "input_blocks.8.1.transformer_blocks.0.attn1.to_q": "down_blocks_2_attentions_1_transformer_blocks_0_"
                                                        "attn1_to_q",
    "middle_block.1.proj_out": "mid_block_attentions_0_proj_out",
    "output_blocks.2.1.conv": "up_blocks_0_upsamplers_0_conv",
    "output_blocks.3.1.proj_in": "up_blocks_1_attentions_0_proj_in",
    "output_blocks.8.2.conv": "up_blocks_2_upsamplers_0_conv",
    "output_blocks.11.0.skip_connection": "up_blocks_3_resnets_2_conv_shortcut",
    "output_blocks.11.1.transformer_blocks.0.attn2.to_v": "up_blocks_3_attentions_2_transformer_blocks_0_"
                                                          "attn2_to_v",
    "time_embed.2": "time_embedding_linear_2",
}


def test_sd15_diffusers_names_come_from_the_fixed_layout_whatever_blocks_a_file_has():
    from patchbay_merge import lora_keys

    present = list(SD15_NAMES)
    for keys in (present, present[::2], present[1::2], present[-2:], [present[0], present[-2]]):
        names = lora_keys.kohya_names([f"model.diffusion_model.{k}.weight" for k in keys], "sd15")
        expected = {f"lora_unet_{SD15_NAMES[k]}": f"model.diffusion_model.{k}.weight" for k in keys}
        expected |= {f"lora_unet_{k.replace('.', '_')}": f"model.diffusion_model.{k}.weight" for k in keys}
        assert names == expected


def test_a_unet_that_does_not_fit_its_architecture_gets_its_own_layout():
    from patchbay_merge import lora_keys

    # one resnet per level, two levels, attention in both (the tiny SD1.5 test UNet)
    blocks = {"input_blocks.1.0", "input_blocks.1.1", "input_blocks.2.0.op", "input_blocks.3.0",
              "input_blocks.3.1", "output_blocks.1.2.conv", "output_blocks.3.1"}
    layout = lora_keys.layout_for("sd15", [f"{b}.x" for b in blocks])
    assert layout == lora_keys.UNetLayout(((1, True), (1, True)))
    assert layout.blocks()["output_blocks.1.2.conv"] == "up_blocks.0.upsamplers.0.conv"
    assert layout.blocks()["output_blocks.3.1"] == "up_blocks.1.attentions.1"


def test_a_lora_on_a_unet_only_file_with_blocks_missing_lands_on_the_right_keys(tmp_path):
    from patchbay_merge import execute, recipe

    gen = torch.Generator().manual_seed(0)
    to_v = "output_blocks.11.1.transformer_blocks.0.attn2.to_v"
    to_k = "input_blocks.1.1.transformer_blocks.0.attn2.to_k"
    base = {f"{to_v}.weight": torch.randn(4, 768, generator=gen),  # UNet-only, 3 of SD1.5's 686 keys
            f"{to_k}.weight": torch.randn(4, 768, generator=gen),
            "output_blocks.2.1.conv.weight": torch.randn(4, 4, 3, 3, generator=gen)}
    save_file(base, str(tmp_path / "unet.safetensors"))
    up, down = torch.randn(4, 2, generator=gen), torch.randn(2, 768, generator=gen)
    conv_up, conv_down = torch.randn(4, 2, 1, 1, generator=gen), torch.randn(2, 4, 3, 3, generator=gen)
    name, conv_name = f"lora_unet_{SD15_NAMES[to_v]}", "lora_unet_up_blocks_0_upsamplers_0_conv"
    save_file({f"{name}.lora_up.weight": up, f"{name}.lora_down.weight": down,
               f"{name}.alpha": torch.tensor(1.0), f"{conv_name}.lora_up.weight": conv_up,
               f"{conv_name}.lora_down.weight": conv_down},
              str(tmp_path / "lora.safetensors"))
    R = recipe
    merged = R.add_difference(R.model(str(tmp_path / "unet.safetensors")),
                              R.model(str(tmp_path / "lora.safetensors"), space="delta"))
    report = execute.merge(merged, tmp_path / "out.safetensors",
                           execute.MergeOptions(dtype="fp32", progress=False, fsync=False))
    assert report.arch == "sd15" and not report.warnings  # nothing "matches no key"
    out = load_file(str(tmp_path / "out.safetensors"))
    expected = base[f"{to_v}.weight"] + up @ down / 2  # alpha / rank = 1 / 2
    torch.testing.assert_close(out[f"model.diffusion_model.{to_v}.weight"], expected)
    conv = base["output_blocks.2.1.conv.weight"] + (conv_up.flatten(1) @ conv_down.flatten(1)).reshape(
        4, 4, 3, 3)
    torch.testing.assert_close(out["model.diffusion_model.output_blocks.2.1.conv.weight"], conv)
    assert torch.equal(out[f"model.diffusion_model.{to_k}.weight"], base[f"{to_k}.weight"])


def test_a_lora_module_that_does_not_fit_its_key_is_one_clear_error(tmp_path):
    from patchbay_merge import execute, recipe

    key = "input_blocks.1.1.transformer_blocks.0.attn2.to_k"
    save_file({f"{key}.weight": torch.zeros(4, 768)}, str(tmp_path / "unet.safetensors"))
    name = "lora_unet_" + key.replace(".", "_")
    save_file({f"{name}.lora_up.weight": torch.ones(5, 2), f"{name}.lora_down.weight": torch.ones(2, 768)},
              str(tmp_path / "lora.safetensors"))  # made for a model 5 wide, not 4
    R = recipe
    merged = R.add_difference(R.model(str(tmp_path / "unet.safetensors")),
                              R.model(str(tmp_path / "lora.safetensors"), space="delta"))
    with pytest.raises(ValueError, match=r"lora.safetensors: its module for model.diffusion_model.input_"
                                         r".*\[4, 768\] does not fit it .*Use a LoRA made for this base"):
        execute.merge(merged, tmp_path / "out.safetensors", execute.MergeOptions(progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.safetensors", "unet.safetensors"]

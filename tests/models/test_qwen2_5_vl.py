"""Qwen2.5-VL (models/qwen2_5_vl.py, its HF loading and export in adapters/hf.py) against transformers'
float32 forward of a tiny random checkpoint, on pixels the model's own image processor makes of
images drawn here: a batch of one image, two images of different sizes, and none."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from helpers import drawn
from unitrain import sharding
from unitrain.adapters import hf
from unitrain.models import qwen2_5_vl

# Logits and features reach ~15; float32 sums in another order move them by ~3e-5.
TOL = dict(atol=2e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def case(tiny_checkpoint):
    """The checkpoint, its transformers model, the images' pixels and grids, and a right-padded batch
    of rows: text, one image, text; text, two images of other sizes (one with windows cut by its
    edge), text; text alone."""
    path = tiny_checkpoint("qwen2_5_vl")
    processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    # 4 x 4, 6 x 10 and 8 x 4 patches: windows of 2 x 2 merged tokens, some cut at the 6 x 10's edge.
    images = processor(images=[drawn(64, 64, "red"), drawn(140, 84, "blue"), drawn(56, 100, "green")])
    grids = [tuple(int(n) for n in g) for g in images["image_grid_thw"]]
    config = json.loads((path / "config.json").read_text())
    start, pad, end = (config[k] for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id"))
    vision = hf.vision_config_from_hf(path)
    text = lambda n, seed: list(np.random.default_rng(seed).integers(3, start - 4, n))  # noqa: E731
    image = lambda g: [start] + [pad] * qwen2_5_vl.image_tokens(g, vision) + [end]  # noqa: E731
    rows = [
        text(3, 0) + image(grids[0]) + text(4, 1),
        text(2, 2) + image(grids[1]) + text(2, 3) + image(grids[2]) + text(3, 4),
        text(9, 5),
    ]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = row
    segments = (np.arange(ids.shape[1]) < np.asarray([len(r) for r in rows])[:, None]).astype(np.int32)
    torch_model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return dict(
        path=path,
        torch_model=torch_model,
        pixels=np.asarray(images["pixel_values"], np.float32),
        grids=grids,
        ids=ids,
        segments=segments,
        lengths=[len(r) for r in rows],
        pad=pad,
    )


def torch_logits(model, case, ids=None, segments=None, images=True):
    ids = case["ids"] if ids is None else ids
    segments = case["segments"] if segments is None else segments
    inputs = dict(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(segments))
    if images:
        inputs.update(
            pixel_values=torch.tensor(case["pixels"]),
            image_grid_thw=torch.tensor(case["grids"]),
            mm_token_type_ids=torch.tensor((ids == case["pad"]).astype(np.int64)),
        )
    with torch.no_grad():
        return model(**inputs).logits.numpy()


@nnx.jit
def encode(model, pixels, layout):
    return model.encode_images(pixels, layout)


@nnx.jit
def forward(model, tokens, positions, segments, features, rope_positions):
    return model(tokens, positions, segments, image_features=features, rope_positions=rope_positions)[0]


def our_logits(model, case, ids, segments):
    vision = model.vision.cfg
    features = encode(model, case["pixels"], qwen2_5_vl.image_layout(case["grids"], vision))
    positions = np.zeros_like(segments)
    for b in range(len(ids)):  # each segment counts from 0
        for s in set(segments[b][segments[b] > 0]):
            positions[b, segments[b] == s] = np.arange(np.sum(segments[b] == s))
    rope = qwen2_5_vl.mrope_positions(ids, segments, case["grids"], case["pad"], vision)
    return np.asarray(forward(model, ids, positions, segments, features, rope)), features


def test_features_and_logits_equal_transformers(case):
    """The tower's features and the logits of every real token equal transformers' float32 forward,
    with one image, two of different sizes, and none in the batch."""
    model = hf.load(case["path"])
    ours, features = our_logits(model, case, case["ids"], case["segments"])
    with torch.no_grad():
        expected_features = case["torch_model"].get_image_features(
            torch.tensor(case["pixels"]), torch.tensor(case["grids"])
        )
    np.testing.assert_allclose(np.asarray(features), torch.cat(expected_features.pooler_output).numpy(), **TOL)
    expected = torch_logits(case["torch_model"], case)
    for b, n in enumerate(case["lengths"]):
        np.testing.assert_allclose(ours[b, :n], expected[b, :n], **TOL)


def test_rows_padded_to_a_budget_encode_as_transformers(case):
    """A training batch's form: two rows of images (the 4 x 4 and 6 x 10 ones; the 8 x 4 one) padded
    to a budget of 96 patches, encoded under a RowLayout, 32 queries at a time: each row's features
    are its images' in transformers' forward, in order."""
    model = hf.load(case["path"], attention_chunk_size=32)
    vision, budget, rows = model.vision.cfg, 96, [[0, 1], [2]]
    starts = np.cumsum([0, *(int(np.prod(g)) for g in case["grids"])])
    pixels = np.zeros((len(rows), budget, case["pixels"].shape[1]), np.float32)
    parts = []
    for b, row in enumerate(rows):
        own = np.concatenate([case["pixels"][starts[i] : starts[i + 1]] for i in row])
        pixels[b, : len(own)] = own
        parts.append(qwen2_5_vl.row_layout([case["grids"][i] for i in row], vision, budget))
    layout = qwen2_5_vl.RowLayout(*(np.concatenate(p) if i == 0 else np.stack(p) for i, p in enumerate(zip(*parts))))
    features = np.asarray(encode(model, pixels.reshape(-1, pixels.shape[-1]), layout)).reshape(
        len(rows), budget // 4, -1
    )
    with torch.no_grad():
        expected = case["torch_model"].get_image_features(torch.tensor(case["pixels"]), torch.tensor(case["grids"]))
    expected = [e.numpy() for e in expected.pooler_output]
    for b, row in enumerate(rows):
        want = np.concatenate([expected[i] for i in row])
        np.testing.assert_allclose(features[b, : len(want)], want, **TOL)


def test_packed_row_equals_its_sequences_apart(case):
    """The image row and the text row packed into one row of two segments: each sequence's logits
    are its own row's in transformers' forward (M-RoPE positions restart with the segment)."""
    model = hf.load(case["path"])
    first, third = case["lengths"][0], case["lengths"][2]
    ids = np.concatenate([case["ids"][0, :first], case["ids"][2, :third]])[None]
    segments = np.repeat([1, 2], [first, third])[None].astype(np.int32)
    only_first = dict(case, pixels=case["pixels"][:16], grids=case["grids"][:1])  # the first image's 4 x 4 patches
    ours, _ = our_logits(model, only_first, ids, segments)
    expected = torch_logits(case["torch_model"], case)
    np.testing.assert_allclose(ours[0, :first], expected[0, :first], **TOL)
    np.testing.assert_allclose(ours[0, first:], expected[2, :third], **TOL)


def test_text_alone_needs_no_image_inputs(case):
    """A text-only batch called as a text model's (no features, no rope positions: 1D RoPE) gives
    transformers' logits without images."""
    model = hf.load(case["path"])
    ids, segments = case["ids"][2:, :9], case["segments"][2:, :9]
    logits, _ = nnx.jit(lambda m, t, p, s: m(t, p, s))(model, ids, np.arange(9)[None], segments)
    np.testing.assert_allclose(np.asarray(logits), torch_logits(case["torch_model"], case, ids, segments, False), **TOL)


def test_rope_positions_equal_transformers(case):
    """mrope_positions equals transformers' get_rope_index on the padded batch's real tokens."""
    vision = hf.vision_config_from_hf(case["path"])
    ours = qwen2_5_vl.mrope_positions(case["ids"], case["segments"], case["grids"], case["pad"], vision)
    expected, _ = case["torch_model"].model.get_rope_index(
        torch.tensor(case["ids"], dtype=torch.long),
        mm_token_type_ids=torch.tensor((case["ids"] == case["pad"]).astype(np.int64)),
        image_grid_thw=torch.tensor(case["grids"]),
        attention_mask=torch.tensor(case["segments"]),
    )
    real = case["segments"] > 0
    np.testing.assert_array_equal(ours[real], expected.numpy().transpose(1, 2, 0)[real])
    with pytest.raises(ValueError, match="more image grids"):
        qwen2_5_vl.mrope_positions(case["ids"], case["segments"], [*case["grids"], (1, 4, 4)], case["pad"], vision)
    with pytest.raises(ValueError, match="fewer image pads"):
        qwen2_5_vl.mrope_positions(case["ids"], case["segments"], [(1, 8, 8), *case["grids"][1:]], case["pad"], vision)


def test_sharded_tower_and_decoder_equal_one_device(case):
    """Loaded onto 8 devices (fsdp 2 x tensor 2 x data 2) under the logical axis rules, the tower's
    weights split by them, the features and logits are the one-device model's."""
    mesh = sharding.create_mesh(dict(data=2, fsdp=2, tensor=2), dict(data=1, fsdp=1, tensor=1))
    model = hf.load(case["path"], mesh=mesh)
    assert model.vision.blocks.w_gate.get_value().sharding.spec == sharding.logical_to_spec(
        ("layers", "embed", "mlp"), sharding.DEFAULT_RULES
    )
    with jax.set_mesh(mesh):
        sharded, features = our_logits(model, case, case["ids"], case["segments"])
    single, single_features = our_logits(hf.load(case["path"]), case, case["ids"], case["segments"])
    np.testing.assert_allclose(np.asarray(features), np.asarray(single_features), **TOL)
    np.testing.assert_allclose(sharded, single, **TOL)


def test_export_round_trip(case, tmp_path):
    """save_hf writes what transformers loads as the same model: every tensor of the source
    checkpoint, bit for bit, and the same config; its forward gives the source's logits."""
    hf.load(case["path"]).save_hf(str(tmp_path))
    source, exported = (
        load_file(str(case["path"] / "model.safetensors")),
        load_file(str(tmp_path / "model.safetensors")),
    )
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
    before, after = (transformers.AutoConfig.from_pretrained(p) for p in (case["path"], tmp_path))
    for field in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert getattr(after, field) == getattr(before, field)
    assert after.text_config.rope_parameters == before.text_config.rope_parameters
    keep = lambda c: {k: v for k, v in c.to_dict().items() if k not in ("initializer_range", "dtype")}  # noqa: E731
    assert keep(after.vision_config) == keep(before.vision_config)
    reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    np.testing.assert_array_equal(torch_logits(reloaded, case), torch_logits(case["torch_model"], case))


def test_cached_decode_after_an_image_prompt_equals_the_full_forward(case):
    """The one-image row as a sampler runs it: its prompt (the image's features in) prefilled into
    the KV cache, then its last tokens one call at a time at their M-RoPE positions: the logits of
    transformers' forward of the whole row."""
    model = hf.load(case["path"])
    n, prompt = case["lengths"][0], case["lengths"][0] - 3
    ids, segments = case["ids"][:1, :n], case["segments"][:1, :n]
    grids = case["grids"][:1]
    vision = model.vision.cfg
    features = encode(model, case["pixels"][:16], qwen2_5_vl.image_layout(grids, vision))
    rope = qwen2_5_vl.mrope_positions(ids, segments, grids, case["pad"], vision)
    positions = np.arange(n)[None]
    call = nnx.jit(lambda m, t, p, s, c, **images: m(t, p, s, c, **images))
    cols = slice(0, prompt)
    logits, cache = call(
        model,
        ids[:, cols],
        positions[:, cols],
        segments[:, cols],
        model.init_cache(1, n),
        image_features=features,
        rope_positions=rope[:, cols],
    )
    steps = [logits]
    for col in range(prompt, n):
        cols = slice(col, col + 1)
        logits, cache = call(
            model, ids[:, cols], positions[:, cols], segments[:, cols], cache, rope_positions=rope[:, cols]
        )
        steps.append(logits)
    expected = torch_logits(case["torch_model"], case)[0, :n]
    np.testing.assert_allclose(np.concatenate(steps, axis=1)[0], expected, **TOL)


def test_tower_gradients_equal_torch_autograd(case):
    """The tower trains: the gradients of a random projection of its features with respect to the
    patch embedding, every block's query projection and the merger are torch autograd's."""
    model = hf.load(case["path"])
    pixels, grids = case["pixels"][16:], case["grids"][1:]
    vision = model.vision.cfg
    probe = np.random.default_rng(0).normal(size=(sum(qwen2_5_vl.image_tokens(g, vision) for g in grids), 64))
    graph, params = nnx.split(model)
    layout = qwen2_5_vl.image_layout(grids, vision)
    loss = lambda p: jnp.sum(nnx.merge(graph, p).encode_images(pixels, layout) * probe)  # noqa: E731
    ours = jax.jit(jax.grad(loss))(params)["vision"]
    tower = case["torch_model"].model.visual
    tower.zero_grad()
    (tower(torch.tensor(pixels), grid_thw=torch.tensor(grids)).pooler_output * torch.tensor(probe)).sum().backward()
    E = vision.hidden_size
    pairs = [
        (ours["patch_embed"][...].transpose(4, 0, 1, 2, 3), tower.patch_embed.proj.weight.grad),
        (ours["merge_w1"][...].T, tower.merger.mlp[0].weight.grad),
        *(
            (ours["blocks"]["wq"][...][i].reshape(E, E).T, b.attn.qkv.weight.grad[:E])
            for i, b in enumerate(tower.blocks)
        ),
    ]
    for got, expected in pairs:
        np.testing.assert_allclose(np.asarray(got), expected.numpy(), atol=1e-4, rtol=1e-5)

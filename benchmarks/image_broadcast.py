"""What a request with a large image costs the per-step broadcast: the bytes rank 0 pickles and
broadcasts to every other rank on the step the request arrives (lockstep.distributed.communication
.broadcast_pyobj pickles the step's list of inputs), as lockstep sends it (content hash + shared-
memory handle, lockstep.multimodal.refs.ImageRef) beside the naive message that carries the
preprocessed pixel tensor itself (the broadcast design before SGLang moved image processing into
the TokenizerManager), with the time to pickle and unpickle each; and the front's one-off work
(decode, HF preprocessing, sha256, the copy into shared memory) and a rank's copy out of it.

    python benchmarks/image_broadcast.py [--side 1200] [--image-size 896] [--repeat 20]

The image is seeded noise saved as PNG (noise does not compress: --side 1200 gives about 4.3 MB);
the preprocessing is Gemma 3's (896x896, the real models' size) with the tiny tokenizer's image
tokens. Results: docs/benchmarks.md, "Images: broadcast bytes per step"."""

from __future__ import annotations

import argparse
import dataclasses
import io
import pickle
import statistics
import time

import numpy as np
from PIL import Image
from transformers import AutoTokenizer
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from lockstep.configs.vision_config import VisionConfig
from lockstep.messages import TokenizedGenerateReq
from lockstep.multimodal.images import ImageLimits
from lockstep.multimodal.layouts import Gemma3Layout
from lockstep.multimodal.processing import ImageInputs
from lockstep.multimodal.shm import read_pixels
from lockstep.sampling_params import SamplingParams
from lockstep.testing.tiny_vision import data_url, make_tiny_vision_model


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _rank(rank: int, port: int, obj: object, repeat: int, out: object) -> None:
    import torch.distributed as dist

    from lockstep.distributed.communication import broadcast_pyobj
    from lockstep.distributed.parallel_state import ParallelGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = ParallelGroup(rank, 2, dist.group.WORLD, dist.group.WORLD, 0, rank)
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        broadcast_pyobj(obj if rank == 0 else [], group)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.value = statistics.median(times) * 1e3
    dist.destroy_process_group()


def gloo_broadcast_ms(obj: object, repeat: int) -> float:
    """Median ms of lockstep's broadcast_pyobj of `obj` from rank 0 to one other rank (gloo, two
    processes on this machine), barrier to barrier."""
    import multiprocessing as mp

    from lockstep.utils.process import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Value("d", 0.0)
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, obj, repeat, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return out.value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", type=int, default=1200)
    ap.add_argument("--image-size", type=int, default=896)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (a.side, a.side, 3), dtype=np.uint8))
    png = io.BytesIO()
    img.save(png, format="PNG")
    url = data_url(img)
    model_dir = make_tiny_vision_model()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vision = VisionConfig("gemma3", 1152, 4304, 27, 16, a.image_size, 14, 1e-6, "gelu_pytorch_tanh",
                          256, 513, 512, 514)
    proc = Gemma3ImageProcessorPil(size={"height": a.image_size, "width": a.image_size})
    inputs = ImageInputs(vision, Gemma3Layout(vision, proc, tok), ImageLimits(max_bytes=64 << 20))
    ids = tok(inputs.expand_text("<start_of_image> What is in this picture?")).input_ids

    t_prepare, prepared = timed(lambda: inputs.prepare(ids, [url]), 1)
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    ours = TokenizedGenerateReq("r", prepared.input_ids, params, images=prepared.images)
    pixels = inputs.pixels(url, "image")
    naive = dataclasses.replace(ours, images=[])
    naive.pixel_values = pixels  # the pre-TokenizerManager design: pixels inside the message

    rows = []
    for name, msg in (("lockstep (hash + shm handle)", ours), ("naive (pixels pickled)", naive)):
        t_dump, data = timed(lambda m=msg: pickle.dumps([m]), a.repeat)
        t_load, _ = timed(lambda d=data: pickle.loads(d), a.repeat)
        rows.append((name, len(data), t_dump * 1e3, t_load * 1e3, gloo_broadcast_ms([msg], a.repeat)))
    ref = prepared.images[0]
    t_read, _ = timed(lambda: read_pixels(ref.shm_name, ref.shape), a.repeat)
    for seg in prepared.segments:
        seg.close()
        seg.unlink()
    print(f"image: {a.side}x{a.side} PNG, {len(png.getvalue()) / 1e6:.2f} MB encoded, "
          f"{len(url) / 1e6:.2f} MB as a data URL; pixels {tuple(pixels.shape)} float32 = "
          f"{pixels.nbytes / 1e6:.2f} MB")
    print(f"front, once per image: decode + preprocess + sha256 + shared memory {t_prepare * 1e3:.0f} ms")
    print(f"a rank, once per image it encodes: copy out of shared memory {t_read * 1e3:.2f} ms")
    print("| broadcast message | bytes on the arrival step | pickle ms | unpickle ms | broadcast_pyobj to 1 rank, ms |")
    print("|---|---:|---:|---:|---:|")
    for name, size, dump, load, bcast in rows:
        print(f"| {name} | {size:,} | {dump:.3f} | {load:.3f} | {bcast:.2f} |")


if __name__ == "__main__":
    main()

"""The detokenizer process: token ids in, incremental text out, stop strings applied."""

from __future__ import annotations

import dataclasses
import logging
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from lockstep.core import FINISH_MATCHED_STR
from lockstep.detokenizer.incremental_detokenizer import IncrementalDetokenizer
from lockstep.messages import BatchStrOut, BatchTokenIDOut, ReqOutput, decode, encode
from lockstep.server_args import PortArgs, ServerArgs
from lockstep.utils.process import configure_logging, die_with_parent, set_title

logger = logging.getLogger(__name__)


class DetokenizerManager:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, IncrementalDetokenizer] = {}
        # Requests a stop string ended here, whose last outputs may still be in flight from the
        # scheduler; they are dropped until the scheduler's own final message arrives.
        self.stopped: set[str] = set()

    def handle(self, batch: BatchTokenIDOut) -> BatchStrOut:
        out: list[ReqOutput] = []
        for o in batch.outputs:
            if o.rid in self.stopped:
                if o.finish_reason is not None:
                    self.stopped.discard(o.rid)
                continue
            det = self.states.get(o.rid)
            if det is None:
                p = o.sampling_params
                det = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=p.skip_special_tokens if p else True,
                    spaces_between_special_tokens=p.spaces_between_special_tokens if p else True,
                    stop=p.stop if p else (), no_stop_trim=p.no_stop_trim if p else False,
                    stop_regex=p.stop_regex if p else (),
                )
                self.states[o.rid] = det
            res = det.push(o.new_token_ids)
            text, reason = res.text_delta, o.finish_reason
            if res.finished and reason is None:
                # The scheduler is stopped by an abort from the tokenizer manager, which knows
                # a detokenizer finish by its FINISH_MATCHED_STR.
                reason = FINISH_MATCHED_STR(res.matched_stop)
                self.stopped.add(o.rid)
            if reason is not None:
                text += det.flush()
                del self.states[o.rid]
            out.append(dataclasses.replace(o, text_delta=text, finish_reason=reason,
                                           sampling_params=None))
        return BatchStrOut(out)


def load_tokenizer(args: ServerArgs):
    from transformers import AutoTokenizer

    from lockstep.model_loader import resolve_model

    path = args.tokenizer_path or str(resolve_model(args.model_path).model_dir)
    return AutoTokenizer.from_pretrained(path)


def run_detokenizer_process(args: ServerArgs, ports: PortArgs, pipe: Connection) -> None:
    die_with_parent()
    set_title("lockstep::detokenizer")
    configure_logging(args.log_level, "detokenizer")
    try:
        manager = DetokenizerManager(load_tokenizer(args))
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.bind(ports.detokenizer_ipc)
        send = ctx.socket(zmq.PUSH)
        send.connect(ports.tokenizer_ipc)
    except Exception as e:  # noqa: BLE001
        logger.error("detokenizer failed to start:\n%s", traceback.format_exc())
        pipe.send({"status": "error", "message": f"detokenizer: {type(e).__name__}: {e}"})
        sys.exit(1)
    pipe.send({"status": "ready"})
    try:
        while True:
            msg = decode(recv.recv())
            send.send(encode(manager.handle(msg) if isinstance(msg, BatchTokenIDOut) else msg))
    except Exception:  # noqa: BLE001
        logger.error("detokenizer crashed:\n%s", traceback.format_exc())
        sys.exit(1)

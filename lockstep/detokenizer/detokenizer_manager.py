"""The detokenizer process: token ids in, incremental text out."""

from __future__ import annotations

import dataclasses
from multiprocessing.connection import Connection
from typing import Any

import zmq

from lockstep.detokenizer.incremental_detokenizer import IncrementalDetokenizer, load_tokenizer
from lockstep.messages import BatchStrOut, BatchTokenIDOut, ReqOutput, decode, encode, zmq_socket
from lockstep.server_args import PortArgs, ServerArgs
from lockstep.utils.process import exit_on_error, start_child
from lockstep.utils.watchdog import ForwardProgressWatchdog


class DetokenizerManager:
    """Turns each request's token ids into text. Stops are the scheduler's: an output's
    `text_limit` says how much of the text is final (what could still become a stop is held back,
    a matched stop is cut off), so a stream never shows part of a stop string."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, IncrementalDetokenizer] = {}

    def handle(self, batch: BatchTokenIDOut) -> BatchStrOut:
        out: list[ReqOutput] = []
        for o in batch.outputs:
            if (det := self.states.get(o.rid)) is None:
                skip, spaces = o.decode_options
                det = self.states[o.rid] = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            det.push(o.new_token_ids)
            if o.finish_reason is not None:
                del self.states[o.rid]
            out.append(dataclasses.replace(o, text_delta=det.release(o.text_limit)))
        return BatchStrOut(out)


def run_detokenizer_process(args: ServerArgs, ports: PortArgs, pipe: Connection) -> None:
    start_child("detokenizer", args.log_level, "detokenizer")
    with exit_on_error("detokenizer", pipe):
        manager = DetokenizerManager(load_tokenizer(args))
        ctx = zmq.Context()
        recv = zmq_socket(ctx, zmq.PULL, ports.detokenizer_ipc)
        send = zmq_socket(ctx, zmq.PUSH, ports.tokenizer_ipc)
    pipe.send({"status": "ready"})
    # Stuck in one message for --watchdog-timeout s: the stacks go to the log, the server down.
    watchdog = ForwardProgressWatchdog(args.watchdog_timeout, "detokenizer").start()
    with exit_on_error("detokenizer"):
        while True:
            msg = decode(recv.recv())
            watchdog.step_begins(True)
            send.send(encode(manager.handle(msg) if isinstance(msg, BatchTokenIDOut) else msg))
            watchdog.step_done(False)

"""Where the prefix cache (prefix_cache.py) checkpoints a prompt's GDN state: the last page boundary before the
prompt's last token (a request always computes and samples from at least one token; not for a chat prompt that
finishes on this worker, whose finished sequence serves its next turn), the end of a chat prompt's first message
(the system prompt other users' conversations share; a tail there) and, optionally, every `checkpoint_interval`
pages; the scheduler ends prefill chunks exactly there (`next_stop`), except at a prompt's last such position when
the chunk runs on to the prompt's end: that step takes the state there in passing (a snapshot, see
ScheduledItem.snapshot_at), so the prompt's last tokens need no step of their own (in a full batch, with no state
slot to keep it in, the step skips that checkpoint rather than stop: Scheduler._snapshot_slots). The cache queues
its copies on the engine's stream right after the step that reached the position, so stream order makes them
exact under async scheduling.

A pure function of the request's tokens and the settings: the cache's own structures play no part."""

from __future__ import annotations

from deltamesh.engine.request import Request


class CheckpointPositions:
    def __init__(self, page_size: int, checkpoint_interval: int | None = None, turn_start: int | None = None):
        """`turn_start`: the id of the token that opens each chat message (None: no turn checkpoints)."""
        self.page_size, self.checkpoint_interval, self.turn_start = page_size, checkpoint_interval, turn_start

    def _last_boundary(self, req: Request) -> int:
        ps = self.page_size
        return (len(req.prompt_ids) - 1) // ps * ps

    def turn_end(self, req: Request) -> int:
        """Where the prompt's first chat message ends (its second message's opening token), if before its last
        token; else 0."""
        prompt = req.prompt_ids
        if self.turn_start is None or not prompt or prompt[0] != self.turn_start:
            return 0
        try:
            end = prompt.index(self.turn_start, 1)
        except ValueError:
            return 0
        return end if end < len(prompt) - 1 else 0

    def _prompt_end(self, req: Request) -> int:
        """The prompt's own checkpoint position (its last page boundary), or 0 for a chat prompt this worker
        finishes: its next turn starts from the whole finished sequence (a tail), so stopping the prefill there
        would cost a step for nothing. A held prompt (prefill worker) never finishes here: it keeps the stop; so does
        one whose copies wait for it (n > 1 choices of a chat: shared_prefill.py)."""
        keeps = req.hold_state or req.keeps_prompt_checkpoint
        return 0 if req.turn_end and not keeps else self._last_boundary(req)

    def next_stop(self, req: Request, after: int | None = None) -> int | None:
        """The next token position (past `after`, default the request's computed tokens) at which the request's
        prefill must end a chunk, or have its state taken there, to checkpoint it."""
        done = req.num_computed if after is None else after
        last = self._last_boundary(req)
        end = self._prompt_end(req)
        stops = [end] if done < end else []
        if done < req.turn_end:
            stops.append(req.turn_end)
        if self.checkpoint_interval:
            step = self.checkpoint_interval * self.page_size
            if (at := (done // step + 1) * step) <= last:
                stops.append(at)
        return min(stops, default=None)

    def is_checkpoint(self, req: Request, pos: int) -> bool:
        """Whether the prompt's state after `pos` tokens is to be kept."""
        last = self._last_boundary(req)
        if pos <= 0 or pos > last:
            return pos == req.turn_end and pos > 0
        step = (self.checkpoint_interval or 0) * self.page_size
        return pos in (self._prompt_end(req), req.turn_end) or (step > 0 and pos % step == 0)

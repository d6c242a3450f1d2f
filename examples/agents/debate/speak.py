"""A conversation that keeps its working set: each `say` feeds only the new turn and decodes the
reply greedily (what the judge and the agents share)."""
from inferlet import chat, model
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax


class Speaker:
    def __init__(self, opening: list[int]):
        self.ws, self.pipe = WorkingSet(), Pipeline()
        self.pending = list(opening)        # tokens not yet in the working set
        self.fed: list[int] = []            # tokens each turn fed

    async def say(self, text: str, max_tokens: int) -> str:
        stops = set(chat.stop_tokens())
        feed, reply = self.pending + chat.user(text) + chat.cue_without_thinking(), []
        self.fed.append(len(feed))
        for _ in range(max_tokens):
            fwd = ForwardPass()
            fwd.embed(feed)
            fwd.state([self.ws], StateGeometry.folding())
            chosen = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
            self.pipe.submit(fwd)
            token = await chosen
            if token in stops:
                feed = []
                break
            reply.append(token)
            feed = [token]
        self.pending = feed + chat.seal()
        return model.decode(reply).strip()

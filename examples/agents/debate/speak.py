"""A conversation that keeps its working set: each `say` feeds only the new turn and decodes the
reply greedily (what the judge and the agents share)."""
from inferlet import chat, model
from inferlet.eta import Pipeline, WorkingSet, generate


class Speaker:
    def __init__(self, opening: list[int]):
        self.ws, self.pipe = WorkingSet(), Pipeline()
        self.pending = list(opening)        # tokens not yet in the working set
        self.fed: list[int] = []            # tokens each turn fed

    async def say(self, text: str, max_tokens: int) -> str:
        stops = set(chat.stop_tokens())
        feed = self.pending + chat.user(text) + chat.cue_without_thinking()
        self.fed.append(len(feed))
        reply = [token async for token in generate(self.ws, self.pipe, feed, max_tokens, stops)]
        # a reply that ended at its stop is all in ws; one cut at max_tokens lacks its last token
        self.pending = (reply[-1:] if len(reply) == max_tokens else []) + chat.seal()
        return model.decode(reply).strip()

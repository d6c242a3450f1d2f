"""One map worker (spawned by main.py): summarises its chunk greedily and streams the summary to
the coordinator as it is decoded, one message per token with a sequence number, then a last
message with the whole summary, so the coordinator can tell a lost or reordered message."""
from inferlet import model, session

from summarise import greedy, prompt


async def main(input: dict) -> dict:
    coordinator, seq = input["coordinator"], 0
    tokens = prompt("Summarise this part of a document:", input["chunk"])

    def stream(token: int) -> None:
        nonlocal seq
        session.send_to(coordinator, {"seq": seq, "token": token})
        seq += 1

    summary = await greedy(tokens, int(input["max_tokens"]), stream)
    session.send_to(coordinator, {"seq": seq, "done": True, "summary": model.decode(summary).strip()})
    return {"index": input["index"], "prompt": tokens, "tokens": summary, "messages": seq + 1}

"""A debate: three agents argue a motion for three rounds, then the judge decides.

This module is the judge. It spawns one agent per stance (agent.py of this bundle, each its own
process, on whatever node the cluster places it) and runs the rounds by messages: each round it
sends every agent what the others said last (`session.send_to`), and takes their arguments with
`session.receive_from`, which says who sent each one. The agents keep their working sets across
rounds, so a round computes only its new tokens. After the last round the judge reads the
arguments and names the side that argued best.

Input (all optional): "motion", "rounds" (3), "max_tokens" per argument (24), "nodes" (Ray node
ids the agents go onto in turn; else the cluster places them).
Output: {"agents": {stance: process name}, "transcript": [{"round", "stance", "text"}],
"verdict", "agents_done": [what each agent returned]}.
"""
import asyncio

from inferlet import chat, runtime, session

from speak import Speaker

STANCES = ("for", "against", "undecided")


async def main(input: dict) -> dict:
    motion = input.get("motion", "Cities should ban cars from their centres.")
    rounds, max_tokens = int(input.get("rounds", 3)), int(input.get("max_tokens", 24))
    me, nodes = runtime.name(), input.get("nodes") or [None]
    agents = {}
    for i, stance in enumerate(STANCES):
        child = await runtime.spawn("agent", {"judge": me, "motion": motion, "stance": stance,
                                              "rounds": rounds, "max_tokens": max_tokens},
                                    name=f"{me}/{stance}", node=nodes[i % len(nodes)])
        agents[stance] = child
    stance_of = {child.name: stance for stance, child in agents.items()}

    transcript, last = [], {}
    for n in range(1, rounds + 1):
        for stance, child in agents.items():
            others = [f"{s}: {t}" for s, t in last.items() if s != stance]
            session.send_to(child.name, {"round": n, "others": others})
        said = {}
        while len(said) < len(agents):
            sender, message = await session.receive_from()
            if sender not in stance_of or message.get("round") != n:
                raise ValueError(f"round {n}: unexpected message from {sender!r}: {message!r}")
            said[stance_of[sender]] = message["text"]
        for stance in STANCES:
            transcript.append({"round": n, "stance": stance, "text": said[stance]})
        last = said
        session.send({"round": n, "said": said})

    judge = Speaker(chat.system("You judge debates. Answer with the side that argued best."))
    arguments = "\n".join(f"{s}: {t}" for s, t in last.items())
    verdict = await judge.say(f"Motion: {motion}\nFinal arguments:\n{arguments}\nWhich side argued best?",
                              max_tokens)
    done = await asyncio.gather(*(child.result() for child in agents.values()))
    return {"agents": {s: c.name for s, c in agents.items()}, "transcript": transcript,
            "verdict": verdict, "agents_done": done}

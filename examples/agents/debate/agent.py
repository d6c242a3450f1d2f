"""One debater (spawned by main.py, the judge): each round it takes what the others said from the
judge, answers with its argument and sends it back; its working set holds the whole debate."""
from inferlet import chat, session

from speak import Speaker


async def main(input: dict) -> dict:
    judge, stance = input["judge"], input["stance"]
    side = "are undecided about" if stance == "undecided" else f"argue {stance}"
    speaker = Speaker(chat.system(f"You are in a debate on the motion: {input['motion']} You {side} "
                                  "the motion. Answer in one short sentence."))
    for n in range(1, int(input["rounds"]) + 1):
        sender, message = await session.receive_from()
        if sender != judge or message["round"] != n:
            raise ValueError(f"{stance}: expected round {n} from {judge!r}, got {message!r} from {sender!r}")
        heard = " ".join(f'The side {line}' for line in message["others"]) or "You speak first."
        text = await speaker.say(f"Round {n}. {heard} Give your argument.",
                                 int(input["max_tokens"]))
        session.send_to(judge, {"round": n, "text": text})
    return {"stance": stance, "rounds": int(input["rounds"]), "fed": speaker.fed, "folded": speaker.ws.folded()}

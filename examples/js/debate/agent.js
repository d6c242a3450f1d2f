// One debater (spawned by main.js, the judge): each round it takes what the others said from the
// judge, answers with its argument and sends it back; its working set holds the whole debate.
import { chat, session } from 'inferlet';
import { Speaker } from './speak.js';

export async function main(input) {
  const { judge, stance } = input;
  const side = stance === 'undecided' ? 'are undecided about' : `argue ${stance}`;
  const speaker = new Speaker(chat.system(`You are in a debate on the motion: ${input.motion} You ${side} ` +
                                          'the motion. Answer in one short sentence.'));
  const rounds = Math.trunc(input.rounds);
  for (let n = 1; n <= rounds; n++) {
    const [sender, message] = await session.receiveFrom();
    if (sender !== judge || message.round !== n) {
      throw new Error(`${stance}: expected round ${n} from '${judge}', got ${JSON.stringify(message)} from '${sender}'`);
    }
    const heard = message.others.map((line) => `The side ${line}`).join(' ') || 'You speak first.';
    const text = await speaker.say(`Round ${n}. ${heard} Give your argument.`, Math.trunc(input.max_tokens));
    session.sendTo(judge, { round: n, text });
  }
  return { stance, rounds, fed: speaker.fed, folded: speaker.ws.folded() };
}

// A debate (examples/agents/debate in JavaScript): three agents argue a motion, then the judge
// decides. This module is the judge: it spawns agent.js of this bundle once per stance (each its
// own process), runs the rounds by messages (session.sendTo, then session.receiveFrom, which says
// who sent each argument), and finally names the side that argued best.
//
// input (all optional): {motion, rounds (3), max_tokens per argument (24), nodes}
//   ->  {agents: {stance: process name}, transcript: [{round, stance, text}], verdict, agents_done}
import { chat, runtime, session } from 'inferlet';
import { Speaker } from './speak.js';

const STANCES = ['for', 'against', 'undecided'];

export async function main(input) {
  const motion = input.motion ?? 'Cities should ban cars from their centres.';
  const [rounds, maxTokens] = [Math.trunc(input.rounds ?? 3), Math.trunc(input.max_tokens ?? 24)];
  const [me, nodes] = [runtime.name(), input.nodes?.length ? input.nodes : [null]];
  const agents = {};
  for (const [i, stance] of STANCES.entries()) {
    agents[stance] = await runtime.spawn('agent', { judge: me, motion, stance, rounds, max_tokens: maxTokens },
                                         { name: `${me}/${stance}`, node: nodes[i % nodes.length] });
  }
  const stanceOf = Object.fromEntries(Object.entries(agents).map(([stance, child]) => [child.name, stance]));

  const transcript = [];
  let last = {};
  for (let n = 1; n <= rounds; n++) {
    for (const [stance, child] of Object.entries(agents)) {
      const others = Object.entries(last).filter(([s]) => s !== stance).map(([s, t]) => `${s}: ${t}`);
      session.sendTo(child.name, { round: n, others });
    }
    const said = {};
    while (Object.keys(said).length < STANCES.length) {
      const [sender, message] = await session.receiveFrom();
      if (!(sender in stanceOf) || message.round !== n) {
        throw new Error(`round ${n}: unexpected message from '${sender}': ${JSON.stringify(message)}`);
      }
      said[stanceOf[sender]] = message.text;
    }
    for (const stance of STANCES) transcript.push({ round: n, stance, text: said[stance] });
    last = said;
    session.send({ round: n, said });
  }

  const judge = new Speaker(chat.system('You judge debates. Answer with the side that argued best.'));
  const argued = Object.entries(last).map(([s, t]) => `${s}: ${t}`).join('\n');
  const verdict = await judge.say(`Motion: ${motion}\nFinal arguments:\n${argued}\nWhich side argued best?`, maxTokens);
  const done = await Promise.all(Object.values(agents).map((child) => child.result()));
  return { agents: Object.fromEntries(Object.entries(agents).map(([s, c]) => [s, c.name])), transcript,
           verdict, agents_done: done };
}

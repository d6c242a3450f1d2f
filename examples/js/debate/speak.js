// A conversation that keeps its working set: each `say` feeds only the new turn and decodes the
// reply greedily (what the judge and the agents share). As examples/agents/debate/speak.py.
import { chat, model, Pipeline, WorkingSet, generate } from 'inferlet';

export class Speaker {
  constructor(opening) {
    this.ws = new WorkingSet();
    this.pipe = new Pipeline();
    this.pending = [...opening];     // tokens not yet in the working set
    this.fed = [];                   // tokens each turn fed
  }

  async say(text, maxTokens) {
    const stops = chat.stopTokens();
    const feed = [...this.pending, ...chat.user(text), ...chat.cueWithoutThinking()];
    this.fed.push(feed.length);
    const reply = [];
    for await (const token of generate(this.ws, this.pipe, feed, maxTokens, stops)) reply.push(token);
    // a reply that ended at its stop is all in ws; one cut at maxTokens lacks its last token
    this.pending = [...(reply.length === maxTokens ? reply.slice(-1) : []), ...chat.seal()];
    return model.decode(reply).trim();
  }
}

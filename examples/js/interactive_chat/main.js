// An interactive chat that keeps its working set across turns (examples/interactive_chat/main.py
// in JavaScript). It waits for each user message with session.receive(), feeds only the new
// tokens into the same working set, and sends each reply as {turn, user, reply, folded_before,
// fed, folded_after, cached_tokens} when it is done. A message is the user's text (or
// {content}); an empty message, null or "/bye" ends the chat.
//
// input (all optional): {system, history: [{role, content}], max_tokens per reply (48), turns}
//   ->  {turns: [...]}
import { chat, model, session, Pipeline, WorkingSet, generate } from 'inferlet';

export async function main(input) {
  const maxTokens = Math.trunc(input.max_tokens ?? 48);
  const limit = input.turns ?? null;
  const stops = chat.stopTokens();
  const [ws, pipe] = [new WorkingSet(), new Pipeline()];
  let pending = chat.system(input.system ?? 'You are a helpful assistant.');    // not yet in ws
  for (const { role, content } of input.history ?? []) {
    pending.push(...(role === 'user' ? chat.user(content) : chat.assistant(content)));
  }

  const turns = [];
  while (limit === null || turns.length < limit) {
    const message = await session.receive();
    const text = message !== null && typeof message === 'object' ? message.content : message;
    if (!text || text === '/bye') break;
    const feed = [...pending, ...chat.user(text), ...chat.cueWithoutThinking()];
    const [foldedBefore, fed] = [ws.folded(), feed.length];
    const reply = [];
    for await (const token of generate(ws, pipe, feed, maxTokens, stops)) reply.push(token);
    // a reply that ended at its stop is all in ws; one cut at maxTokens lacks its last token
    pending = [...(reply.length === maxTokens ? reply.slice(-1) : []), ...chat.seal()];
    const turn = { user: text, reply: model.decode(reply), folded_before: foldedBefore, fed,
                   folded_after: ws.folded(), cached_tokens: ws.cachedTokens() };
    session.send({ turn: turns.length + 1, ...turn });
    turns.push(turn);
  }
  pipe.close();
  return { turns };
}

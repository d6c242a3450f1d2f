// inferlet: the JavaScript SDK, importable by an inferlet as "inferlet" or "@pie-project/inferlet".
//
// The same surface as the Python SDK (pie_actors/inferlet/sdk/inferlet), its names in camelCase:
// every function calls the same host operation with the same JSON arguments (ops.py lists them),
// and an epilogue traced here is the same IR text as the Python one, so the engine compiles one
// program for both. What Python awaits is a Promise here; the runner (runner.js) resolves them
// from the host's completions. The modules under sdk/ hold the parts.

import { eta } from './sdk/trace.js';

export { HostError, _host } from './sdk/host.js';
export { model, chat } from './sdk/model.js';
export { session, runtime, http, Child, HttpError, Response } from './sdk/session.js';
export { Tensor, trace, canonicalJson, float, intrinsics, dtype, eta } from './sdk/trace.js';
export { WorkingSet, StateGeometry, Channel, Mask, unpackMask, ForwardPass, Pipeline, generate } from './sdk/passes.js';
export { Grammar, Matcher, tools, reasoning } from './sdk/structured.js';

export const {
  add, sub, mul, div, neg, abs, exp, log, cos, l2norm, matmul, maxElem, minElem, eq, ne, lt, le, gt, ge, and, select,
  maskApply, reshape, broadcast, cast, constant, iota, indptr, reduceMax, reduceSum, reduceArgmax,
  cumsum, cumprod, cummassLe, softmax, logSoftmax, entropy, entropyFromLogprobs, topK,
  nucleusSample, gumbel, gumbelMax, maskedArgmax, gather, gatherRow, causalMask,
} = eta;

"""Everything that holds model weights and KV pages: engine/ (batching, data plane), model/ (the
model, its loading and tensor parallelism), kernels/ (attention and the fast decode path) and eta/
(the epilogue compiler). Nothing is imported here: inferlet hosts read `engine.wire` without torch."""

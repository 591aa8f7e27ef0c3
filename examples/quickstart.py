import anyio
import redis.asyncio as redis

from sink import Assembler, AsyncRedisStagingSink, CaptureGate, RedisCaptureLedger, RolloutReader, finished
from sink.server import DurableServer
from worker import RolloutTokenCapture


async def rollout_step(url: str) -> None:
    async with AsyncRedisStagingSink.from_url(url) as sink, RedisCaptureLedger.from_url(url) as ledger:
        gate, capture = CaptureGate(ledger), RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 7)
        request, response = [{"role": "user", "content": "2+3?"}], [{"role": "assistant", "content": "5"}]
        admission = await gate.admit("rollout-1", request)  # the gate admits the call for capture
        call = await capture.abegin_call(admission)  # the inference worker begins it ...
        coords = await capture.acomplete_call(  # ... and stages its tokens durably before it responds
            call, prompt_token_ids=[101, 102], generated_token_ids=[7, 8], generated_logprobs=[-0.5, -0.1]
        )
        await gate.commit(admission, coords, response_id="resp-1", request_items=request, response_items=response)
        async with redis.Redis.from_url(url) as client:
            await finished(client, "rollout-1", reward=1.0)  # the rollout is scored
    async with Assembler.from_url(url) as assembler, RolloutReader.from_url(url) as reader, anyio.create_task_group() as tg:
        tg.start_soon(assembler.run)  # builds the receipt
        [pulled] = await reader.pull(1, block_ms=5_000)  # the trainer: fetched, verified, linearized
        print(pulled.row.token_ids, pulled.row.token_mask, pulled.row.as_numpy().logprobs)
        await reader.ack([pulled.rollout_id])  # deletes the staged rows, retires the ledger
        assembler.stop()


with DurableServer() as server:  # a private server with AOF fsync always; or use your own URL
    anyio.run(rollout_step, server.url)

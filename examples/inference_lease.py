"""An inference pipeline sharing GPU 0 through gpud's leases: the README's and docs/leases.md's example, run by the tests.

    GPUD_SOCKET=/path/to/gpud.sock python examples/inference_lease.py

The four models are stand-ins (a sleep and a string each), so it runs anywhere a daemon does.
"""

import time

from gpud_client import Client


class OutOfMemoryError(Exception):
    """Stands in for torch.cuda.OutOfMemoryError."""


def model(seconds: float, result: str) -> str:
    time.sleep(seconds)                    # the stand-ins' GPU (or slower CPU) work
    return result


def whisper_gpu(audio: bytes) -> str:      # speech to text
    return model(0.010, audio.decode())


def whisper_cpu(audio: bytes) -> str:
    return model(0.050, audio.decode())


def repair_llm(text: str) -> str:          # the LLM's semantic repair
    return model(0.020, text.capitalize())


def nmt_gpu(text: str) -> str:             # translation
    return model(0.005, f"[de] {text}")


def nmt_cpu(text: str) -> str:
    return model(0.025, f"[de] {text}")


def tts_gpu(text: str) -> bytes:           # text to speech
    if len(text) > 40:                     # a long utterance does not fit in the GPU's memory
        raise OutOfMemoryError("CUDA out of memory")
    return model(0.005, text).encode()


def tts_cpu(text: str) -> bytes:
    return model(0.020, text).encode()


gpu = Client(name="pipeline")              # --socket / $GPUD_SOCKET / /run/gpud/gpud.sock


def handle(utterance: bytes, job_id: str, session_id: str, index: int) -> bytes:
    trace = {"job_id": job_id, "session_id": session_id, "utterance_index": index}
    with gpu.lease("gpu:0", task_type="ASR", mem_estimate="3GiB", trace={**trace, "stage": "asr"}) as r:
        text = whisper_gpu(utterance) if r.acquired else whisper_cpu(utterance)   # WAIT: SKIPPED only after 3 s
    with gpu.lease("gpu:0", task_type="SEMANTIC_REPAIR", mem_estimate="6GiB",
                   trace={**trace, "stage": "repair"}) as r:
        if r.acquired:
            text = repair_llm(text)            # busy GPU: SKIPPED within 400 ms and the chain goes on
    with gpu.lease("gpu:0", task_type="NMT", mem_estimate="2GiB", trace={**trace, "stage": "nmt"}) as r:
        translated = nmt_gpu(text) if r.acquired else nmt_cpu(text)
    with gpu.lease("gpu:0", task_type="TTS", mem_estimate="1GiB", trace={**trace, "stage": "tts"}) as r:
        try:
            return tts_gpu(translated) if r.acquired else tts_cpu(translated)
        except OutOfMemoryError:
            gpu.report_oom("gpu:0", "TTS")     # counted in gpud_gpu_oom_total{gpu, task_type}
            return tts_cpu(translated)


utterances = [b"good morning", b"where is the station", b"the train to the airport leaves from platform four"]
for index, utterance in enumerate(utterances):
    print(handle(utterance, job_id="job-1", session_id="call-7", index=index).decode())
gpu.close()
print("handled", len(utterances), "utterances")

"""What passes between two stages: one tensor, or a tuple of tensors (e.g. hidden states and an integer
mask), as DeepSpeed's PipelineModule allows.

A message's *spec* is its structure: (is_tuple, ((dtype, shape), ...)). The first message of a stream
goes out with its spec encoded in one small integer tensor (`encode` / `decode`), so that the receiver
can allocate; later messages of the stream have the same spec, unless the PipelineModule says
`dynamic_shape=True`, when every message goes out with its spec.
Gradients flow back for the floating-point tensors only (an integer mask has none), so a gradient
message's spec follows from the activations it answers (`grad_spec`).
"""
import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool)
META_SIZE = 64  # longs: 2 + per tensor (dtype, ndim, shape): room for 6 tensors of 8 dimensions


def tensors(message):
    return list(message) if isinstance(message, tuple) else [message]


def spec_of(message):
    return isinstance(message, tuple), tuple((t.dtype, tuple(t.shape)) for t in tensors(message))


def empty(spec, device):
    """Tensors to receive a message of `spec` into, as it travels (`wire`); `restore` turns them back."""
    is_tuple, parts = spec
    out = tuple(torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=device)
                for dtype, shape in parts)
    return out if is_tuple else out[0]


def restore(message, spec):
    """A received message with the dtypes of its spec (bool travels as uint8)."""
    out = tuple(t.bool() if dtype == torch.bool else t for t, (dtype, _) in zip(tensors(message), spec[1]))
    return out if spec[0] else out[0]


def encode(message, device):
    """The spec of `message` as one long tensor of META_SIZE entries."""
    is_tuple, parts = spec_of(message)
    flat = [int(is_tuple), len(parts)]
    for dtype, shape in parts:
        flat += [DTYPES.index(dtype), len(shape), *shape]
    if len(flat) > META_SIZE:
        raise ValueError(f"a message of {len(parts)} tensors with these shapes does not fit the {META_SIZE}-entry "
                         f"shape message: {parts}")
    meta = torch.zeros(META_SIZE, dtype=torch.long)
    meta[:len(flat)] = torch.tensor(flat)
    return meta.to(device)  # NCCL sends device tensors only


def decode(meta):
    flat = meta.cpu().tolist()
    parts, at = [], 2
    for _ in range(flat[1]):
        dtype, ndim = DTYPES[flat[at]], flat[at + 1]
        parts.append((dtype, tuple(flat[at + 2:at + 2 + ndim])))
        at += 2 + ndim
    return bool(flat[0]), tuple(parts)


def wire(t):
    """The tensor as sent: contiguous, and bool as uint8 (NCCL sends no bool)."""
    return t.contiguous().to(torch.uint8) if t.dtype == torch.bool else t.contiguous()


def as_input(message, grad_enabled):
    """A received (or handed-over) message as a stage input: detached, floating tensors requiring grad."""
    out = tuple(t.detach().requires_grad_(grad_enabled and t.is_floating_point()) for t in tensors(message))
    return out if isinstance(message, tuple) else out[0]


def input_grads(inputs):
    """The gradient message a stage sends back for `inputs`: the gradients of its floating tensors (zeros
    where one did not reach the input)."""
    grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                  for t in tensors(inputs) if t.is_floating_point())
    return grads if isinstance(inputs, tuple) else grads[0]


def grad_spec(outputs):
    """The spec of the gradient message that answers activations `outputs`."""
    is_tuple, parts = spec_of(outputs)
    return is_tuple, tuple(p for p in parts if p[0].is_floating_point)

"""Pure-PyTorch definitions of the math: the chunked reference (the fallback backend) and the token-by-token
recurrence it is checked against."""

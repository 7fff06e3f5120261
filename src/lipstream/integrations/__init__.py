"""LipStream inside the agent stacks: `integrations.pipecat` (a Pipecat video service) and
`integrations.livekit` (a LiveKit Agents avatar). Each imports its stack, an optional extra
(`lipstream[pipecat]`, `lipstream[livekit]`); nothing else in lipstream imports them.
"""

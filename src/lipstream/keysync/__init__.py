"""KeySync: the high-resolution lip-sync model (keyframes, then the frames between them), on LipStream's avatars."""

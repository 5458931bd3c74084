/* Empty stand-in: nccl.h includes it for half-precision types inprocess never uses. */
#pragma once

/* Stands in for the CUDA runtime header that nccl.h includes: the real one
 * needs nvcc's crt/ headers, which no small wheel ships. nccl.h takes only
 * cudaStream_t from it (for collectives inprocess never calls); the driver
 * types the check compares come from the real cuda.h. */
#pragma once
#include <cuda.h>
typedef CUstream cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
